"""``ddp-course autograde``: grade every submission on nbgrader, N at a time or on Slurm, resumable.

* :mod:`~course.instructor.autograde.command`: the verb and its options;
* :mod:`~course.instructor.autograde.run`: a local run (plan, grade on the pool, merge, summary);
* :mod:`~course.instructor.autograde.slurm`: a run on a Slurm cluster (one job array, merged here);
* :mod:`~course.instructor.autograde.records`: which submissions are graded, each outcome's record;
* :mod:`~course.instructor.autograde.scratch`: the private scratch course each submission is graded in;
* :mod:`~course.instructor.autograde.pool` and :mod:`~course.instructor.autograde.worker`: the
  worker processes that run nbgrader's autograde, one submission at a time each.
"""

from course.instructor.autograde.command import command
from course.instructor.autograde.records import Row, Status, Submission, summary_table
from course.instructor.autograde.run import AutogradeRun, run_autograde

__all__ = ["AutogradeRun", "Row", "Status", "Submission", "command", "run_autograde", "summary_table"]
