"""Say first why a test failed when an earlier cell timed out or raised: the cause before the symptom.

A ``while True: pass`` above ``def shard_batch`` makes that answer cell time out, so
``shard_batch`` is never defined and its test says "`shard_batch` was not defined when this
test ran": true, but the cause (the timeout) was only in the answer cell's own output.
:func:`explain_failures` rewrites every failing test cell of an executed notebook so that its
message names, first, each earlier non-test cell that timed out (with its limit) or raised (the
exception's type and first line), by position and grade_id or what it defines, and only then
what the test missed::

    before this test, cell 3 (ex1_shard_batch, which defines `shard_batch`) timed out after 60 s (its time limit)
    then this test failed: FAILED check_shards: `shard_batch` was not defined when this test ran

The grading pipeline calls it once the verifier's verdicts are in the test cells
(:class:`course.grading.pipeline.VerifyTests`), so ``ddp-course grade``, autograde (the message
nbgrader records, which feedback shows) and ``ddp-course check`` all say it; the in-process
grading of tests calls it after its run. A cell that raised ``NotImplementedError`` is not a
cause: that is nbgrader's stub in an answer not written yet, which the checks already report.
"""

from __future__ import annotations

import ast
import re

import nbformat
from nbformat import NotebookNode

from course.grading.cells import is_test_cell, nbgrader_meta
from course.grading.notebook import TIMEOUT_ENAME

#: what a cell may raise without being reported as a cause: the template's stub (the checks say "not
#: written yet"), and the markers of cells the grader never ran or stopped (their tests say "not run: ...")
NOT_A_CAUSE = {"NotImplementedError", "NotRun", "KernelStopped"}
#: the ename of a failing test cell's output once its causes are prepended (the verifier's own, so every
#: reader of check messages, nbgrader's feedback included, shows it as a check's message)
EXPLAINED_ENAME = "CheckFailed"
THEN = "then this test failed: "


def defined_names(source: str) -> list[str]:
    """The top-level functions, classes and variables a cell's source defines (none where it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return list(dict.fromkeys(names))


def describe_cell(cell: NotebookNode, index: int) -> str:
    """``cell 3 (ex1_shard_batch, which defines `shard_batch`)``: a cell by its position, grade_id and what it defines."""
    labels = []
    gid = nbgrader_meta(cell).get("grade_id")
    if gid:
        labels.append(str(gid))
    written = re.match(r"\s*%%writefile\s+(?:-a\s+)?(\S+)", cell.get("source", ""))
    names = defined_names(cell.get("source", ""))
    if written:
        labels.append(f"which writes {written.group(1)}")
    elif names:
        shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
        labels.append(f"which defines {shown}")
    return f"cell {index}" + (f" ({', '.join(labels)})" if labels else "")


def cell_failure(cell: NotebookNode) -> str | None:
    """What went wrong in a non-test cell that ran: ``timed out after 60 s (its time limit)``, ``raised
    ZeroDivisionError: division by zero``; None when it ran to its end (or only hit the template's stub)."""
    if cell.get("cell_type") != "code":
        return None
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    for out in errors:
        if out.get("ename") == TIMEOUT_ENAME:
            found = re.search(r"after (\S+) s\b", str(out.get("evalue", "")))
            return f"timed out after {found.group(1)} s (its time limit)" if found else "timed out (its time limit)"
    if not errors or any(o.get("ename") in NOT_A_CAUSE for o in errors):
        return None
    err = errors[-1]
    ename = str(err.get("ename") or "an error")
    lines = [line.strip() for line in str(err.get("evalue", "")).splitlines() if line.strip()]
    return f"raised {ename}: {lines[0]}" if lines else f"raised {ename}"


def _fails(cell: NotebookNode) -> bool:
    """nbgrader's rule: an error output or anything on stderr scores the test cell 0."""
    return any(o.get("output_type") == "error" or (o.get("output_type") == "stream" and o.get("name") == "stderr")
               for o in cell.get("outputs", []))


def explain_failures(nb: NotebookNode, ran: set[int] | None = None) -> NotebookNode:
    """Prepend to each failing test cell's message the earlier non-test cells that timed out or raised (in place).

    ``ran``: the indices of the cells that ran (:attr:`course.grading.notebook.Execution.ran`); by default
    the cells with an execution count, as a kernel leaves them.

    Only test cells that ran and fail by nbgrader's rule change: their error outputs become one
    ``CheckFailed`` error whose message is the causes, one per line, then ``then this test failed: `` and
    the message the cell had (:func:`course.grading.scoring.failure_message`); a stderr output stays,
    so the score is what it was. Test cells that were not run keep their "not run: ..." (already the cause).
    """
    from course.grading.scoring import failure_message

    causes: list[str] = []
    for index, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code" or not (index in ran if ran is not None
                                                   else cell.get("execution_count") is not None):
            continue
        if not is_test_cell(cell):
            what = cell_failure(cell)
            if what:
                causes.append(f"before this test, {describe_cell(cell, index)} {what}")
            continue
        if not causes or not _fails(cell):
            continue
        missed = failure_message(cell)
        if missed.startswith(causes[0]):  # explained already (a pipeline step run twice)
            continue
        message = "\n".join(causes) + "\n" + THEN + (missed or "it failed")
        cell.outputs = [o for o in cell.get("outputs", []) if o.get("output_type") != "error"] + [
            nbformat.v4.new_output("error", ename=EXPLAINED_ENAME, evalue=message, traceback=message.splitlines())]
    return nb
