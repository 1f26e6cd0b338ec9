"""``ddp-course autograde`` and ``k8s-job``: grade every submission on nbgrader, here N at a time, on Slurm or
on Kubernetes, resumable.

How it works. nbgrader grades a submission in a private scratch course (:mod:`.scratch`) on a worker
process (:mod:`.pool`, :mod:`.worker`); only the process holding the course lock (:mod:`.guards`) merges
an outcome into the real gradebook (:func:`.merge.finish`) and writes its record (:mod:`.records`). A
local run (:mod:`.run`) does all of that in one process. A batch run (:mod:`.batch`) prepares the scratch
courses and a manifest in a run folder, its tasks grade their shares wherever a scheduler starts them
and write outcome files, and the process that collects merges them; while a run holds a submission,
every verb leaves it to that run (:func:`.batch.elsewhere`). The schedulers are clients of the batch run:
:mod:`.slurm` submits one job array and follows it, :mod:`.k8s` writes an Indexed Job.

* :mod:`.command`: the ``autograde`` verb and its options; :mod:`.k8s`: the ``k8s-job`` verb;
* :mod:`.run`: a local run (plan, grade on the pool, merge, summary);
* :mod:`.batch`: a batch run (manifest, prepare, held submissions, collect, the task);
* :mod:`.slurm`, :mod:`.k8s`: the Slurm and Kubernetes clients;
* :mod:`.merge`, :mod:`.config`, :mod:`.guards`: one outcome into the course, what the course's config
  decides for a run (time limit, sandbox), the course lock and signal handling;
* :mod:`.records`: which submissions are graded, each outcome's record;
* :mod:`.scratch`: the private scratch course each submission is graded in;
* :mod:`.pool` and :mod:`.worker`: the worker processes that run nbgrader's autograde, one submission at a
  time each.

Imports go one way: records, scratch, pool/worker, config, guards, merge at the bottom; batch on them; run
on batch; slurm and k8s on run and batch; command on run and slurm. Nothing here imports the verbs
outside the package; names with a leading underscore stay in their module.

Entry points: ``ddp-course autograde`` (:func:`.command.command`), ``ddp-course k8s-job``
(:func:`.k8s.command`); in a batch run's task, ``python -m course.instructor.autograde.batch task MANIFEST
INDEX``; first in a Kubernetes pod, ``python -m course.instructor.autograde.k8s preflight``.
"""

from course.instructor.autograde.command import command
from course.instructor.autograde.records import Row, Status, Submission, summary_table
from course.instructor.autograde.run import AutogradeRun, run_autograde

__all__ = ["AutogradeRun", "Row", "Status", "Submission", "command", "run_autograde", "summary_table"]
