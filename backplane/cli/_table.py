"""Plain-text tables for the listing commands."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Return ``rows`` as left-aligned columns under ``headers``.

    The last column is not padded, so long reasons do not leave trailing blanks.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths[:-1], strict=True)]
        return "  ".join([*padded, cells[-1]]).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])
