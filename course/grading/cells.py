"""What grading calls each kind of cell, and how long each may run: one definition for every step.

nbgrader marks cells in their metadata: a *test cell* (``grade: true``, not a
solution, code) is scored from its outputs; an *answer cell* (``solution: true``)
holds the student's code. A test cell may hold *hidden tests* between
``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``: the student's copy has
them removed, grading puts them back, and nothing the student's code can read may
ever hold them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: nbgrader's hidden-test region markers (a line containing the text marks it)
HIDDEN_BEGIN, HIDDEN_END = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
HIDDEN_MARKERS = (HIDDEN_BEGIN, HIDDEN_END)

#: seconds a test cell may run (its checks start real multi-rank jobs; exercise 4 starts torchrun)
TEST_CELL_TIMEOUT = 300.0
#: seconds any other cell may run (answer cells only define functions); the course's own
#: code cells (imports, setup, demos) get :data:`TEST_CELL_TIMEOUT`: see :meth:`Timeouts.for_cell`
OTHER_CELL_TIMEOUT = 60.0
#: seconds one job of a check may run before its ranks are killed (a deadlock, an endless loop);
#: the environment variable overrides it, for the checks in a kernel, the verifier and their ranks
CHECK_TIMEOUT = 60.0
TIMEOUT_ENV = "DDP_COURSE_CHECK_TIMEOUT"


def check_timeout() -> float:
    """The per-job deadline of checks: ``DDP_COURSE_CHECK_TIMEOUT`` seconds, else :data:`CHECK_TIMEOUT`."""
    try:
        return float(os.environ.get(TIMEOUT_ENV, CHECK_TIMEOUT))
    except ValueError:
        return CHECK_TIMEOUT


#: what the checks' jobs in this process ran on, oldest first ("gloo, GPUs hidden", "nccl"): :func:`course.checks.run`
#: notes each job; the verifier reads and clears it around each test cell, and the grade report shows it
RAN_ON: list[str] = []


def note_ran_on(backend: str, hidden: bool) -> None:
    """Note one check job's backend (``hidden``: the GPUs were hidden from its ranks)."""
    RAN_ON.append(f"{backend}, GPUs hidden" if hidden else backend)
    del RAN_ON[:-100]  # a kernel that runs checks for hours keeps only the latest


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def is_test_cell(cell) -> bool:
    """A code cell nbgrader scores automatically: ``grade: true`` and not a solution."""
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def is_given_code(cell) -> bool:
    """A code cell the course wrote and the student cannot change: ``locked: true`` and not a solution.

    Grading puts these back from the source (:func:`course.grading.restore.restore`, nbgrader's
    ``OverwriteCells``), so what they run is the instructor's: imports, setup, demos that start jobs.
    """
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("locked")) and not meta.get("solution")


def holds_hidden_tests(text: str | bytes) -> bool:
    """Whether ``text`` (a cell's source, a notebook file's bytes) holds a hidden-test region."""
    marker = HIDDEN_BEGIN.encode() if isinstance(text, bytes) else HIDDEN_BEGIN
    return marker in text


@dataclass(frozen=True)
class Timeouts:
    """Seconds each cell may run: test cells run multi-rank checks, so they get longer.

    The course's own code cells (:func:`is_given_code`) get the test cells' limit too. Their time
    is not the student's to spend: the first one imports torch cold, which on a busy grading machine
    took longer than an answer cell's limit, and a limit hit there scored every later cell 0 for a
    right answer. A student who marks a cell of their own ``locked`` (autograde keeps unknown
    grade_ids) gains no more time than a test cell calling their code already has.
    """

    test: float = TEST_CELL_TIMEOUT
    other: float = OTHER_CELL_TIMEOUT

    def for_cell(self, cell) -> float:
        """nbclient's ``timeout_func`` (nbgrader's ``Execute.timeout_func``): this cell's limit."""
        return self.test if is_test_cell(cell) or is_given_code(cell) else self.other
