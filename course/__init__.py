"""ddp-course: learn PyTorch distributed training by running it.

The engine's public names: :func:`run_ranks` runs a function on N ranks,
:func:`backend` says which backend a job uses.
"""

from course.errors import LaunchError, RankFailedError, RankFailure, RankStallError, RankTimeoutError
from course.launcher.job import JobResult, backend, launch, run_ranks, warm_up

__version__ = "0.1.0"

from course.launcher import display as _display  # noqa: E402 - after the public names it shows

_display.install()  # in a notebook: a failed job or check shows the student's frames and the message, once

__all__ = [
    "JobResult",
    "LaunchError",
    "RankFailedError",
    "RankFailure",
    "RankStallError",
    "RankTimeoutError",
    "__version__",
    "backend",
    "launch",
    "run_ranks",
    "warm_up",
]
