"""ddp-course: learn PyTorch distributed training by running it.

The engine's public names: :func:`run_ranks` runs a function on N ranks,
:func:`backend` says which backend a job uses, :func:`hint` gives the next level of a failed check's message,
:func:`show_progress` shows a student on the class server what they ran and passed.
"""

from course.errors import LaunchError, RankFailedError, RankFailure, RankStallError, RankTimeoutError
from course.launcher.job import JobResult, backend, launch, run_ranks, warm_up

__version__ = "0.1.0"


def hint(check: str | None = None) -> None:
    """Print the next level of the last failure of ``check`` (default: the last failed check) and record that it was
    asked for: level 2 the idea and the lesson section that teaches it, level 3 where your code breaks it."""
    from course.student.hint import hint as next_hint

    next_hint(check)  # printed, not returned: a cell's last line would show it twice


def show_progress() -> None:
    """On the class server: what you ran and passed so far (lessons run to the end, each check's last result, the
    hints you asked for), as your progress page shows it."""
    from course.progress import show_progress as show

    show()


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
    "hint",
    "launch",
    "run_ranks",
    "show_progress",
    "warm_up",
]
