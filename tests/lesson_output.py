"""Reading what an executed lesson printed: a cell's stdout, and the world sizes its demos recorded."""

from __future__ import annotations

import re

#: the line every multi-rank demo prints from what its ranks reported
MARKER = re.compile(r"ran on world_size=(\d+) \(backend=(gloo|nccl)\)")


def stdout_of(cell) -> str:
    """Everything the cell printed on stdout (rank output arrives there as ``[rank r] ...``)."""
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def cell_with(nb, needle: str):
    """The one code cell whose source contains ``needle``."""
    cells = [c for c in nb.cells if c.cell_type == "code" and needle in c.source]
    assert len(cells) == 1, f"expected one code cell containing {needle!r}, found {len(cells)}"
    return cells[0]


def output_of(nb, needle: str) -> str:
    return stdout_of(cell_with(nb, needle))


def world_sizes(text: str) -> list[int]:
    """The world sizes recorded in ``text``, in order."""
    return [int(ws) for ws, _ in MARKER.findall(text)]
