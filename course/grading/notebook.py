"""Read a notebook and execute it in a fresh kernel, with a time limit per cell.

:func:`execute` runs every code cell in order, like nbgrader's autograde: a cell
that fails or times out gets an error output and the next cell runs. The result,
:class:`Execution`, says which cells ran, so a cell that never ran (the kernel
died earlier) is never mistaken for a cell that passed. :mod:`course.grading.inprocess`
offers the same interface without a kernel, for fast grading in tests.
"""

from __future__ import annotations

import subprocess
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


def execute(nb: NotebookNode, cwd: str | Path, timeouts: Timeouts = Timeouts(), kernel_name: str = "python3") -> Execution:
    """Run ``nb`` (in place) in a fresh ``kernel_name`` kernel started in ``cwd``."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    run = Execution(nb)
    current = {"index": None}

    def on_cell_execute(cell, cell_index, **_):
        current["index"] = cell_index

    def on_cell_executed(cell, cell_index, execute_reply, **_):
        run.ran.add(cell_index)
        content = (execute_reply or {}).get("content", {})
        if content.get("status") == "error" and content.get("ename") == TIMEOUT_ENAME:
            cell.outputs.append(timeout_output(timeouts.for_cell(cell)))

    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout_func=timeouts.for_cell,
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "", "traceback": []},
        record_timing=False,
        # nbgrader's choice: no history database for a throwaway kernel
        extra_arguments=["--HistoryManager.hist_file=:memory:"],
        on_cell_execute=on_cell_execute,
        on_cell_executed=on_cell_executed,
    )
    try:
        # The kernel's own stdout/stderr (not the cells' output, which comes as
        # messages) must not reach ours: `grade --json` prints only JSON there.
        client.execute(cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except DeadKernelError:
        index = current["index"]
        run.aborted = "the kernel died"
        if index is not None:
            gid = nb.cells[index].get("metadata", {}).get("nbgrader", {}).get("grade_id")
            run.aborted += f" while running cell {index}" + (f" ({gid})" if gid else "")
        if index is not None:
            cell = nb.cells[index]
            cell.outputs.append(nbformat.v4.new_output(
                "error", ename="DeadKernelError", evalue="the kernel died while running this cell", traceback=[]))
            run.ran.add(index)
    return run
