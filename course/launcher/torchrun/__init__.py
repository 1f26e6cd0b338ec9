"""Run a script under real torchrun, with the same diagnosis as :func:`course.launcher.run_ranks`.

How it works: :func:`run_script` starts ``python -m torch.distributed.run`` (one agent, or two
joined by a c10d rendezvous) on :mod:`~course.launcher.torchrun.torchrun_probe`, which every
worker runs: it records what the worker really did (its environment, checkpoint writes and
renames, optimizer steps, ``destroy_process_group``, its collectives) and then runs the script as
``__main__``. While the job runs, the launcher's deadlock watch (:mod:`course.launcher.stall`)
reads the workers' collectives and stops a job that can no longer finish. The result is a
:class:`Run` of :class:`Worker` records (:mod:`~course.launcher.torchrun.runner`);
:func:`failure` says why a run did not finish, the root cause first
(:mod:`~course.launcher.torchrun.diagnosis`). Exercise 4's checks (:mod:`graders.ex4`) judge a
run; nothing here knows about exercises.
"""

from course.launcher.torchrun.diagnosis import failure, require_ok, student_traceback
from course.launcher.torchrun.runner import (
    CRASH_RANK,
    CRASH_STEP,
    NODES_TIMEOUT,
    NODES_WORKERS,
    PROBE_SCRIPT,
    RESTART_TIMEOUT,
    RESTART_WORKERS,
    Run,
    Scenario,
    Worker,
    run_script,
)

__all__ = [
    "CRASH_RANK",
    "CRASH_STEP",
    "NODES_TIMEOUT",
    "NODES_WORKERS",
    "PROBE_SCRIPT",
    "RESTART_TIMEOUT",
    "RESTART_WORKERS",
    "Run",
    "Scenario",
    "Worker",
    "failure",
    "require_ok",
    "run_script",
    "student_traceback",
]
