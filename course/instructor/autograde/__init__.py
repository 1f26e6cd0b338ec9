"""``ddp-course autograde``: grade every submission on nbgrader, N at a time, resumable.

* :mod:`~course.instructor.autograde.run`: the verb (plan, grade on the pool, merge, summary);
* :mod:`~course.instructor.autograde.records`: which submissions are graded, each outcome's record;
* :mod:`~course.instructor.autograde.scratch`: the private scratch course each submission is graded in;
* :mod:`~course.instructor.autograde.pool` and :mod:`~course.instructor.autograde.worker`: the
  worker processes that run nbgrader's autograde, one submission at a time each.
"""

from course.instructor.autograde.records import Row, Status, Submission, summary_table
from course.instructor.autograde.run import AutogradeRun, command, run_autograde

__all__ = ["AutogradeRun", "Row", "Status", "Submission", "command", "run_autograde", "summary_table"]
