"""Notebooks as grading reads them, and what executing one produced.

:func:`read` reads a notebook (or says why it cannot); :class:`Execution` is what an
execution produced: which cells ran, so a cell that never ran (the kernel died earlier)
is never mistaken for a cell that passed; :func:`timeout_output` is the error output of a
cell stopped at its time limit. Executing is the pipeline's step (:mod:`course.grading.execute`,
a sandboxed kernel) or, for trusted notebooks in tests, :func:`course.grading.inprocess.run_in_process`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from course.errors import NotebookError  # noqa: F401 - re-exported
from course.grading.cells import Timeouts  # noqa: F401 - re-exported

#: the ename of the error output a timed-out cell gets
TIMEOUT_ENAME = "CellTimeoutError"


@dataclass
class Execution:
    """An executed notebook and what happened to its cells."""

    nb: NotebookNode
    #: indices of the code cells that ran to the end (or were stopped by their timeout)
    ran: set[int] = field(default_factory=set)
    #: why execution stopped before the last cell ("" when every cell ran)
    aborted: str = ""
    #: report-level lines from the pipeline: how isolated the run was, cells graded from their own output
    notes: list[str] = field(default_factory=list)
    #: grade id -> the failed check of that test cell: ``{"check", "package", "levels"}``, its message at every
    #: hint level (:mod:`course.grading.hints`)
    hints: dict[str, dict] = field(default_factory=dict)


def read(path: str | Path) -> NotebookNode:
    """The notebook at ``path`` (nbformat 4), or a :class:`NotebookError` saying why not."""
    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"{path}: no such notebook")
    try:
        return nbformat.read(str(path), as_version=4)
    except Exception as exc:  # noqa: BLE001 - JSON errors, validation errors, encodings ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotebookError(f"{path}: not a readable notebook ({reason})") from None


def timeout_output(seconds: float) -> NotebookNode:
    """The error output of a cell stopped by its time limit."""
    text = f"cell timed out after {seconds:g} s"
    return nbformat.v4.new_output("error", ename=TIMEOUT_ENAME, evalue=text, traceback=[f"{TIMEOUT_ENAME}: {text}"])


def clear_outputs(nb: NotebookNode) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
