"""What every check shares: the failure a student reads, and running their code on ranks.

A check is a plain function called from a one-line nbgrader test cell. It runs
the student's functions as real ranks through :func:`run_job`, inspects what
happened on every rank, and either returns quietly (the cell passes; a short
"passed" line on stdout is fine) or raises :class:`CheckFailed`. IPython shows
a ``CheckFailed`` as its message only (``_render_traceback_``): the student sees
which check, which rank, what was expected, what happened and what to try,
never a traceback from the graders' own code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from course.exceptions import LaunchError, RankTimeoutError
from course.launch import JobResult, launch

DEFAULT_TIMEOUT = 60.0


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(set(ranks))
    if not ranks:
        return ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in str(text).rstrip().splitlines())


class CheckFailed(AssertionError):
    """A check found a mistake in the student's code. ``str()`` is the full student-facing message."""

    def __init__(
        self,
        check: str,
        problem: str,
        *,
        ranks: Iterable[int] = (),
        expected: Any = None,
        got: Any = None,
        hint: str | None = None,
        detail: str | None = None,
    ):
        self.check = check
        self.problem = problem
        self.ranks = sorted(set(ranks))
        self.expected = expected
        self.got = got
        self.hint = hint
        self.detail = detail
        super().__init__(self.render())

    def render(self) -> str:
        where = f" [{_ranks(self.ranks)}]" if self.ranks else ""
        lines = [f"FAILED {self.check}{where}: {self.problem}"]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.got is not None:
            lines.append(f"  got:      {self.got}")
        if self.hint:
            lines.append(f"  try:      {self.hint}")
        if self.detail:
            lines.append(_indent(self.detail, "  | "))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def _render_traceback_(self) -> list[str]:
        # IPython renders this instead of a traceback through the graders' frames.
        return self.render().splitlines()


def passed(check: str, points: float | None = None) -> None:
    """Print the one line a passing check shows (on stdout: nbgrader zeroes a cell with stderr)."""
    suffix = f" ({points:g} points)" if points is not None else ""
    print(f"passed {check}{suffix}")


def run_job(
    check: str,
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
) -> JobResult:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks for ``check``; a crash or hang becomes a CheckFailed."""
    try:
        return launch(fn, world_size, args=args, timeout=timeout, echo=False, env=env)
    except RankTimeoutError as err:
        raise CheckFailed(
            check,
            f"the {world_size}-rank job did not finish within {err.timeout:g} s "
            f"({_ranks(err.running)} still running, {_ranks(err.returned) or 'no rank'} returned)",
            ranks=err.running,
            hint="a rank that waits forever is usually in a collective (all_reduce, barrier, DDP backward) "
            "that another rank never reached, e.g. a collective inside `if rank == 0:`, or a loop that "
            "never ends; every rank must call the same collectives in the same order",
            detail=_last_output(err),
        ) from None
    except LaunchError as err:
        first = err.ranks[0] if err.ranks else None
        failure = err.failures.get(first) if first is not None else None
        if failure is not None and failure.kind == "raised":
            problem = f"your code raised {failure.exc_type}: {failure.message}".rstrip(": ")
            detail = failure.traceback
        elif failure is not None:
            problem = f"a rank died: {failure.message}"
            detail = "\n".join(failure.last_output)
        else:
            problem, detail = "the job failed", str(err)
        raise CheckFailed(
            check,
            f"{problem} ({world_size}-rank job)",
            ranks=err.ranks,
            hint="read the traceback below (it starts in your code); run the cell on its own with "
            "course.run_ranks to see every rank's output",
            detail=detail,
        ) from None


def _last_output(err: LaunchError) -> str:
    parts = []
    for rank in sorted(err.failures):
        lines = err.failures[rank].last_output
        if lines:
            parts.append(f"rank {rank} was at:\n" + _indent("\n".join(lines[-8:])))
    return "\n".join(parts)


def expect(condition: bool, check: str, problem: str, **kwargs) -> None:
    """Raise CheckFailed(check, problem, **kwargs) unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(check, problem, **kwargs)
