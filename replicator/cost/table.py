"""Plain-text tables for the reports (``explain``, predictions): left-aligned columns.

>>> print(format_table(("name", "bytes"), [("w", "4096"), ("bias", "16")]))
name  bytes
----  -----
w     4096
bias  16
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` (strings) as aligned columns, a dashed rule under the header."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    table.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(table)
