"""The course's late-submission plugin for nbgrader (see :mod:`course.instructor.late` for the whole of late work).

A module of its own, importing nothing of the course: it imports nbgrader, which takes seconds, and
:mod:`course.instructor.late` (which ``ddp-course init`` and ``duedate`` use to write and read the policy)
does not.
"""

from __future__ import annotations

import math

from nbgrader.plugins import LateSubmissionPlugin
from traitlets import Enum, Float

SECONDS = {"hour": 3600, "day": 86400}


class LatePolicy(LateSubmissionPlugin):
    """nbgrader's late-submission plugin with a penalty per started hour or day late, capped.

    nbgrader's own ``penalty_method = "zero"`` still works (a late notebook scores 0)."""

    penalty = Float(0.0, help="Percent of a notebook's points taken per started `per` late (0: no penalty).").tag(
        config=True)
    per = Enum(("hour", "day"), default_value="day", help="The unit late time is counted in.").tag(config=True)
    cap = Float(100.0, help="The most percent of a notebook's points a late penalty takes.").tag(config=True)

    def late_submission_penalty(self, student_id: str, score: float, total_seconds_late: float) -> float | None:
        if self.penalty_method == "zero":
            return super().late_submission_penalty(student_id, score, total_seconds_late)
        if total_seconds_late <= 0 or self.penalty <= 0:
            return None
        return round(self._max_score(score) * self.percent(total_seconds_late) / 100, 4)

    def percent(self, seconds_late: float) -> float:
        """The percent of a notebook's points taken for ``seconds_late``."""
        if seconds_late <= 0 or self.penalty <= 0:
            return 0.0
        return min(self.cap, self.penalty * math.ceil(seconds_late / SECONDS[self.per]))

    def _max_score(self, score: float) -> float:
        """The late notebook's points (AssignLatePenalties, the parent, has its gradebook open)."""
        parent = self.parent
        try:
            notebook = parent.gradebook.find_submission_notebook(parent.notebook_id, parent.assignment_id,
                                                                 parent.student_id)
            return float(notebook.max_score)
        except Exception:  # not under AssignLatePenalties: the score obtained is all there is to go by
            return float(score)

    def describe(self) -> str:
        """The policy in words, for the verbs' output and the README's examples."""
        if self.penalty_method == "zero":
            return "late work scores 0 (nbgrader's penalty_method = 'zero')"
        if self.penalty <= 0:
            return "late work is marked, not penalised"
        return (f"{self.penalty:g}% of a notebook's points per {self.per} late (each started {self.per} counts), "
                f"at most {self.cap:g}%")
