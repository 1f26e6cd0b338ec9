"""The launcher: run a Python function as N real ranks of a torch.distributed job.

How it works: :func:`run_ranks` / :func:`launch` (:mod:`~course.launcher.job`, the caller's
side) pickle the function by value, make one :class:`~course.launcher.spec.RankSpec` per
rank and fork the ranks from a warm forkserver (:mod:`~course.launcher.forkserver`, torch
preloaded). Each rank (:mod:`~course.launcher.rank`) sets itself up like a torchrun worker,
runs the function and reports through files in the job's folder; the caller reads the ranks'
output as it grows (:mod:`~course.launcher.output`), watches for deadlocks
(:mod:`~course.launcher.stall`), and returns a :class:`JobResult` or raises an error that
says which rank did what (:mod:`course.errors`).

Owns: the ranks' processes, the forkserver, this process's launcher settings (set once
by :func:`configure`, :mod:`~course.launcher.settings`). May import: the bottom layer
(:mod:`course.proc`, :mod:`course.envnames`, :mod:`course.errors`) and the sandbox; never
grading, the instructor's verbs or the checks.
Entry points: :func:`run_ranks`, :func:`launch`, :func:`warm_up`, :func:`backend`, :func:`configure`.
"""

from course.envnames import BACKEND_ENV, CPUS_ENV, GRADING_ENV
from course.launcher.job import (
    JobResult,
    backend,
    cpus,
    dumps,
    launch,
    resolve_backend,
    run_ranks,
    warm_up,
)
from course.launcher.settings import configure

__all__ = [
    "BACKEND_ENV",
    "CPUS_ENV",
    "GRADING_ENV",
    "JobResult",
    "backend",
    "configure",
    "cpus",
    "dumps",
    "launch",
    "resolve_backend",
    "run_ranks",
    "warm_up",
]
