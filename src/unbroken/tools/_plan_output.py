"""``unbroken plan``'s output: the figures of `plan.plan` as a terminal table, and drawn as
overhead against the interval between saves (a PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._runview import UsageError
from .._table import table

_INSTALL = "pip install 'unbroken[plot]'"


def _num(x: float) -> str:
    """Three significant digits, trailing zeros kept (``10.0``, ``4.76``), no exponent."""
    r = float(f"{x:.3g}")
    return f"{r:.0f}" if abs(r) >= 100 else f"{r:#.3g}"


def duration(seconds: float) -> str:
    """``30`` -> ``30.0 s``, ``600`` -> ``10.0 min``, ``86400`` -> ``24.0 h``."""
    if seconds == 0:
        return "0 s"
    if seconds < 120:
        return f"{_num(seconds)} s"
    if seconds < 2 * 3600:
        return f"{_num(seconds / 60)} min"
    return f"{_num(seconds / 3600)} h"


def percent(fraction: float) -> str:
    """``0.047619`` -> ``4.76%`` (two decimals; smaller ones in two significant digits)."""
    value = 100 * fraction
    return f"{value:.2f}%" if value >= 0.01 or value == 0 else f"{value:.2g}%"


def format_plan(result: dict[str, Any], sources: Sequence[str] = ()) -> str:
    """The human-readable report of a `plan` result; ``sources`` are lines said first."""
    c, lines = result["save_seconds"], list(sources)
    lines.append(f"save cost {duration(c)}"
                 + (f", MTBF {duration(result['mtbf_hours'] * 3600)}"
                    if result["mtbf_hours"] else "")
                 + f", restart {duration(result['restart_seconds'])}")
    if result["young_seconds"] is not None:
        lines.append(f"Young sqrt(2CM): {duration(result['young_seconds'])}; Daly: "
                     f"{duration(result['daly_seconds'])}"
                     + (" (= MTBF: a save costs at least twice the MTBF)"
                        if result.get("daly_bounded") else "")
                     + "; recommended: Daly")
    hours = result["hours"]
    headers = ["interval", "compute between saves", "save overhead", "lost per failure",
               "total with failures"] + ([f"lost over {_num(hours)} h"] if hours else [])
    body = []
    for i in result["intervals"]:
        total, lost = i["total_overhead"], i["expected_lost_seconds"]
        body.append([i["label"] + (" (recommended)" if i["label"] == result["recommended"]
                                   else ""),
                     duration(i["seconds"]), percent(i["save_overhead"]),
                     duration(i["lost_per_failure_seconds"]),
                     percent(total) if total is not None else "-"]
                    + ([duration(lost) if lost is not None else "-"] if hours else []))
    lines += ["", table(headers, body, right=tuple(range(1, len(headers))), indent="  ")]
    if result.get("daly_bounded"):  # the first-order totals exceed 100% in this regime
        lines.append("\nnote: the totals are first order in 1/M and not meaningful when a save "
                     "costs this much against the MTBF")
    if result["expected_failures"] is not None:
        lines.append(f"\nover {_num(hours)} h: {_num(result['expected_failures'])} expected "
                     "failures")
    elif hours:
        lines.append(f"\nover {_num(hours)} h: failures unknown without --mtbf-hours")
    return "\n".join(lines)


def plot_plan(result: dict[str, Any], path: str) -> None:
    """Draw save overhead (and total overhead with failures when the MTBF is known) against
    the compute time between saves, log-x, marking the evaluated intervals."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"--plot needs matplotlib: {_INSTALL}") from None
    c, r, mh = result["save_seconds"], result["restart_seconds"], result["mtbf_hours"]
    m = mh * 3600 if mh else None
    marks = [i["seconds"] for i in result["intervals"]]
    lo, hi = min(marks) / 30, max(marks) * 30
    xs = [lo * (hi / lo) ** (k / 299) for k in range(300)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([x / 60 for x in xs], [100 * c / (x + c) for x in xs], color="black",
            linewidth=2, label="save overhead C/(T+C)")
    if m is not None:
        ax.plot([x / 60 for x in xs], [100 * (c / (x + c) + ((x + c) / 2 + r) / m) for x in xs],
                color="tab:blue", linewidth=1.5, label="total with failures")
    styles = {"given": ("tab:orange", ":"), "Young": ("tab:gray", "--"),
              "Daly": ("tab:red", "-")}
    for i in result["intervals"]:
        color, style = styles.get(i["label"], ("tab:green", "-."))
        name = i["label"] + (" (recommended)" if i["label"] == result["recommended"] else "")
        ax.axvline(i["seconds"] / 60, color=color, linestyle=style, linewidth=1,
                   label=f"{name}: {duration(i['seconds'])}")
    tops = [i["total_overhead"] or i["save_overhead"] for i in result["intervals"]]
    ax.set_ylim(0, min(100.0, 400 * max(tops)))  # the curves run off to 100% at both ends
    ax.set_xscale("log")
    ax.set_xlabel("compute between saves (minutes)")
    ax.set_ylabel("share of wall time (%)")
    ax.set_title(f"unbroken plan: save {duration(c)}"
                 + (f", MTBF {duration(m)}" if m else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
