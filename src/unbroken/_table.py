"""Plain-text helpers for the CLI: aligned columns and human-readable sizes. No dependencies."""

from __future__ import annotations

from collections.abc import Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``. Binary units, 3 significant digits."""
    if n is None:
        return "-"
    size = float(n)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)} B"
    return f"{size:.3g} {unit}" if size < 1000 else f"{size:.0f} {unit}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]],
          right: Sequence[int] = (), indent: str = "") -> str:
    """Columns padded to their widest cell, two spaces apart; ``right`` lists the indices of
    right-aligned (numeric) columns. The last column is never padded, so a long free-text
    column there does not widen the table."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        out = []
        for i, c in enumerate(r):
            if i == len(r) - 1:
                out.append(c.rjust(widths[i]) if i in right else c)
            else:
                out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        lines.append(indent + "  ".join(out).rstrip())
    return "\n".join(lines)
