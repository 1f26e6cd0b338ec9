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


def assert_clean_run(nb, *, images: int) -> None:
    """No cell raised or wrote to stderr, and at least ``images`` plots were drawn."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.outputs:
            assert output.output_type != "error", f"{output.ename}: {output.evalue}"
            assert output.get("name") != "stderr", f"stderr in cell:\n{cell.source[:200]}\n---\n{output.text}"
    drawn = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(drawn) >= images, f"{len(drawn)} plots drawn, expected at least {images}"


def assert_summary_and_quick_check(nb, *, answers: int) -> None:
    """The lesson ends with a summary and a quick check whose ``answers`` answers are folded away."""
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Summary" in markdown and "## Quick check" in markdown
    assert markdown.count("<details>") >= answers
