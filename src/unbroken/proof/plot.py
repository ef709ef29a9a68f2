"""PNG of a check: per-step loss of the reference and of each resumed run, and the per-step
difference (log scale), with each resume point marked. Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import UnbrokenError


def plot_check(report: Any, path: str) -> None:
    """Draw ``report`` (a `harness.CheckReport`) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnbrokenError("--plot needs matplotlib: pip install 'unbroken[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    steps, losses = zip(*report.reference_loss) if report.reference_loss else ((), ())
    top.plot(steps, losses, color="black", linewidth=2.5, label="uninterrupted")
    for case in report.cases:
        c = case.comparison
        if c is None or not c.loss:
            continue
        kills = ", ".join(str(k.kill.at) for k in case.kills)
        label = f"interrupted at {kills}: {case.verdict}"
        x, y = zip(*c.loss)
        line, = top.plot(x, y, linewidth=1, linestyle="--", label=label)
        for resumed in c.resumes:
            top.axvline(resumed, color=line.get_color(), linewidth=0.6, alpha=0.6)
        tiny = 1e-12  # exact zeros cannot be drawn on a log scale
        dx, dy = zip(*c.loss_diff)
        bottom.plot(dx, [max(v, tiny) if not math.isnan(v) else tiny for v in dy],
                    color=line.get_color(), linewidth=1)
    top.set_ylabel("loss")
    top.set_title(f"unbroken check: {report.verdict}")
    top.legend(fontsize=7)
    bottom.set_yscale("log")
    bottom.set_ylabel("|loss - uninterrupted|\n(1e-12 = identical)")
    bottom.set_xlabel("completed updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
