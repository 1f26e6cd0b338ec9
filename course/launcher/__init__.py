"""The launcher: run a Python function as N real ranks of a torch.distributed job.

:mod:`course.launcher.job` is the caller's side (:func:`run_ranks`, :func:`launch`,
the warm forkserver, deadlines and reports); :mod:`course.launcher.rank` is what
runs inside each rank process.
"""

from course.launcher.job import (
    BACKEND_ENV,
    CPUS_ENV,
    GRADING_ENV,
    JobResult,
    backend,
    cpus,
    dumps,
    launch,
    resolve_backend,
    run_ranks,
    warm_up,
)

__all__ = [
    "BACKEND_ENV",
    "CPUS_ENV",
    "GRADING_ENV",
    "JobResult",
    "backend",
    "cpus",
    "dumps",
    "launch",
    "resolve_backend",
    "run_ranks",
    "warm_up",
]
