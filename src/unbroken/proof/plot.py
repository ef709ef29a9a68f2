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
    for n, case in enumerate(report.cases, 1):
        c = case.comparison
        if c is None or not c.loss:
            continue
        # A kill and the resume after it are different steps (a kill inside update 4 resumes
        # from 3): the legend names both, and the vertical lines are the resumes.
        kills = ", ".join(str(k.kill.at) for k in case.kills if k.reached)
        resumes = ", ".join(str(s) for s in c.resumes)
        label = (f"case {n}, {case.verdict}: killed at update {kills}; resumed from step "
                 f"{resumes} (vertical lines)")
        x, y = zip(*c.loss)
        line, = top.plot(x, y, linewidth=1, linestyle="--", label=label)
        for resumed in c.resumes:
            top.axvline(resumed, color=line.get_color(), linewidth=0.6, alpha=0.6)
        tiny = 1e-12  # exact zeros cannot be drawn on a log scale
        dx, dy = zip(*c.loss_diff)
        # NaN or inf (a loss gone NaN on one side): above every finite difference, marked,
        # never at the "identical" floor
        above = max([v for v in dy if math.isfinite(v)] + [tiny]) * 100
        bottom.plot(dx, [max(v, tiny) if math.isfinite(v) else above for v in dy],
                    color=line.get_color(), linewidth=1)
        bad = [x for x, v in zip(dx, dy) if not math.isfinite(v)]
        if bad:
            bottom.scatter(bad, [above] * len(bad), color=line.get_color(), marker="x",
                           label=f"case {n}: NaN or infinite difference")
        d = c.first_divergence
        if d is not None:
            for ax in (top, bottom):
                ax.axvline(d.step, color=line.get_color(), linestyle=":", linewidth=1.5,
                           label=f"case {n}: first differs at update {d.step} ({d.field})"
                           if ax is top else None)
    top.set_ylabel("loss")
    top.set_title(f"unbroken check: {report.verdict}")
    top.legend(fontsize=7)
    bottom.set_yscale("log")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=7)
    bottom.set_ylabel("|loss - uninterrupted|\n(1e-12 = identical)")
    bottom.set_xlabel("completed updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
