"""Score the test cells of an executed notebook by nbgrader's rules, with a reason for every lost point.

The score of a cell comes from :func:`nbgrader.utils.determine_grade`, exactly as
autograde computes it: an error output or ANY output on stderr scores 0; a last
expression that reads as a number gives partial credit; anything else gives full
marks. Two guards nbgrader lacks: a test cell that never ran scores 0 (not full
marks for having no error), and partial credit above the cell's points is capped
instead of crashing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from nbformat import NotebookNode
from nbgrader.utils import determine_grade

from course.grading.notebook import TIMEOUT_ENAME, Execution
from course.grading.restore import GradedCell


@dataclass
class CellResult:
    """One test cell's outcome."""

    #: the cell's nbgrader grade_id
    id: str
    score: float
    max_score: float
    #: why points were lost ("" when the cell passed)
    message: str = ""


@dataclass
class GradeReport:
    """A graded notebook; ``to_json()`` is the ``ddp-course grade --json`` output."""

    notebook: str
    score: float
    max_score: float
    tests: list[CellResult] = field(default_factory=list)
    #: report-level lines: what the sandbox protected, test cells graded from the notebook's own output
    notes: list[str] = field(default_factory=list)
    #: test id -> what its check jobs ran on, as the verifier saw them ("gloo, GPUs hidden", "nccl"); a test whose
    #: cell started no job through the check API (or was not verified) has no entry
    ran_on: dict[str, list[str]] = field(default_factory=dict)
    #: test id -> its failed check's message at every hint level (the test's ``message`` shows level 1, as the
    #: feedback does: :mod:`course.grading.hints`); for the instructor, and ``ddp-course check --hint``
    hints: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _stderr(cell: NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


def failure_message(cell: NotebookNode) -> str:
    """What a failing cell's outputs say: the check's message, the error, a timeout or the stderr text."""
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    timeouts = [o for o in errors if o.get("ename") == TIMEOUT_ENAME]
    if timeouts:
        return timeouts[-1].get("evalue", "cell timed out")
    if errors:
        err = errors[-1]
        ename, evalue = err.get("ename", "Error"), str(err.get("evalue", "")).strip()
        if ename == "CheckFailed":
            return evalue
        return f"{ename}: {evalue}" if evalue else ename
    text = _stderr(cell).strip()
    if text:
        lines = text.splitlines()
        return "wrote to stderr: " + "\n".join(lines[:5]) + ("\n..." if len(lines) > 5 else "")
    return ""


def score_cell(cell: NotebookNode, max_score: float, ran: bool, why_not_run: str = "") -> CellResult:
    """Score one test cell (already executed) out of ``max_score`` (the source's points)."""
    gid = cell.metadata["nbgrader"]["grade_id"]
    if not ran:
        return CellResult(gid, 0.0, max_score, f"not run: {why_not_run or 'an earlier cell stopped the notebook'}")
    try:
        score, _ = determine_grade(cell)
    except ValueError:  # nbgrader: "partial credit cannot be greater than maximum points"
        score = max_score
    if score is None:  # a manually graded answer cell: nothing automatic to give
        return CellResult(gid, 0.0, max_score, "graded by hand: not scored here")
    score = float(score)
    score = 0.0 if math.isnan(score) else min(max(score, 0.0), max_score)
    message = failure_message(cell) if score < max_score else ""
    if score < max_score and not message:
        message = f"partial credit: {score:g} of {max_score:g}"
    return CellResult(gid, score, max_score, message)


def ran_on(cell: NotebookNode) -> list[str]:
    """What a graded test cell's check jobs ran on (the verifier's record in its metadata), or []."""
    return [str(r) for r in (cell.get("metadata", {}).get("ddp_course") or {}).get("ran_on") or []]


def score_notebook(run: Execution, graded: list[GradedCell], name: str) -> GradeReport:
    """Score every graded cell of the source (by grade_id) in the executed notebook."""
    cells = {}
    for index, cell in enumerate(run.nb.cells):
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid is not None and gid not in cells:
            cells[gid] = (index, cell)
    tests, backends = [], {}
    for g in graded:
        if g.grade_id not in cells:
            tests.append(CellResult(g.grade_id, 0.0, g.points, "test cell missing"))
            continue
        index, cell = cells[g.grade_id]
        cell.metadata["nbgrader"]["points"] = g.points
        tests.append(score_cell(cell, g.points, index in run.ran, run.aborted))
        if ran_on(cell):
            backends[g.grade_id] = ran_on(cell)
    levels = {t.id: list(run.hints[t.id]["levels"]) for t in tests if t.message and t.id in run.hints}
    return GradeReport(name, sum(t.score for t in tests), sum(t.max_score for t in tests), tests, ran_on=backends,
                       hints=levels)
