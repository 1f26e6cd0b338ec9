"""Execute a notebook inside this process, without a kernel: fast grading for tests.

A Jupyter kernel costs seconds to start and a cold process pool for the ranks;
running the cells in an IPython shell inside the current process reuses both.
It follows the kernel closely enough for grading (the same IPython machinery,
magics included; stdout, stderr and warnings captured per cell; the last
expression's value as ``execute_result``; a per-cell time limit), but the cells
share this process with its caller: use it for trusted notebooks (tests), and the
grading pipeline (:func:`course.grading.grade.grade_notebook`, whose execute step runs a
sandboxed kernel: :mod:`course.grading.execute`) for students' work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from course.errors import CheckFailed
from course.grading import hints
from course.grading.notebook import Execution, Timeouts, timeout_output


class CellTimeout(BaseException):
    """Raised inside a cell at its time limit (a BaseException, so `except Exception` in a cell cannot swallow it)."""


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.reset(new_session=True)
    # The shell installs its namespace as sys.modules["__main__"]; multiprocessing reads
    # __main__.__spec__ when it starts processes, as a kernel's real __main__ has it.
    shell.user_ns.setdefault("__spec__", None)
    return shell


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise CellTimeout in this (main) thread after ``seconds``; no limit off the main thread."""
    if threading.current_thread() is not threading.main_thread() or not seconds:
        yield
        return

    def handler(signum, frame):
        raise CellTimeout()

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _kernel_like_warnings():
    """Python's default warning filters, as in a fresh kernel (pytest changes them)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
        warnings.filterwarnings("ignore", category=ImportWarning)
        warnings.filterwarnings("ignore", category=ResourceWarning)
        yield


def _run_cell(shell, cell: NotebookNode, seconds: float, hint_levels: dict | None = None) -> None:
    from IPython.utils.capture import capture_output

    outputs = []
    result = None
    with capture_output(display=False) as captured, _kernel_like_warnings():
        try:
            with _time_limit(seconds):
                result = shell.run_cell(cell.source, store_history=False)
        except CellTimeout:
            result = None
            outputs_timeout = True
        else:
            outputs_timeout = False
    stdout = captured.stdout  # includes IPython's "Out[n]:" echo; only stderr and errors affect the score
    if stdout:
        outputs.append(nbformat.v4.new_output("stream", name="stdout", text=stdout))
    if captured.stderr:
        outputs.append(nbformat.v4.new_output("stream", name="stderr", text=captured.stderr))
    error = None if result is None else (result.error_before_exec or result.error_in_exec)
    if outputs_timeout or isinstance(error, CellTimeout):
        outputs.append(timeout_output(seconds))
    elif isinstance(error, CheckFailed):  # as the verifier's verdict: level 1, the other levels for --hint
        hints.attach(error)
        outputs.append(nbformat.v4.new_output("error", ename="CheckFailed", evalue=error.render(1), traceback=[]))
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid is not None and hint_levels is not None:
            hint_levels[str(gid)] = {"check": error.check, "package": error.package or "", "levels": hints.levels(error)}
    elif error is not None:
        outputs.append(nbformat.v4.new_output("error", ename=type(error).__name__, evalue=str(error), traceback=[]))
    elif result is not None and result.result is not None:
        data, metadata = shell.display_formatter.format(result.result)
        outputs.append(nbformat.v4.new_output("execute_result", data=data, metadata=metadata, execution_count=None))
    cell.outputs = outputs


def run_in_process(nb: NotebookNode, cwd: str | Path, timeouts: Timeouts = Timeouts()) -> Execution:
    """Run the code cells of ``nb`` (in place) in this process's IPython shell, started fresh, in ``cwd``."""
    run = Execution(nb)
    saved_main = sys.modules.get("__main__")  # the shell installs its own namespace as __main__
    shell = _shell()
    sys.modules["__main__"] = shell.user_module
    old_cwd = os.getcwd()
    os.chdir(cwd)
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            _run_cell(shell, cell, timeouts.for_cell(cell), run.hints)
            run.ran.add(index)
    finally:
        os.chdir(old_cwd)
        shell.reset(new_session=True)
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
    return run
