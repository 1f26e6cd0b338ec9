"""Errors raised by the launcher. Their text is written for students to read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankFailure:
    """What one rank left behind when it did not return normally."""

    rank: int
    #: "raised", "exited" (died without a Python exception), "stopped" (killed by
    #: the launcher after another rank failed) or "timeout" (still running at the deadline)
    kind: str
    #: the student's traceback (their frames first), or "" when the rank left none
    traceback: str = ""
    #: exception class name, e.g. "AssertionError" ("" when none)
    exc_type: str = ""
    #: str() of the exception
    message: str = ""
    #: process exit code (negative: killed by that signal), None while running
    exitcode: int | None = None
    #: the last lines the rank printed (stdout and stderr interleaved)
    last_output: list[str] = field(default_factory=list)
    #: the exception object itself, when it could be sent back
    exception: BaseException | None = None


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


class LaunchError(RuntimeError):
    """Base class: a multi-rank job did not complete."""

    def __init__(
        self,
        summary: str,
        failures: dict[int, RankFailure],
        returned: list[int],
        world_size: int,
        order: list[int] | None = None,
    ):
        self.summary = summary
        self.order = list(order or [])
        self.failures = failures
        self.returned = returned
        self.world_size = world_size
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.summary]
        stopped = sorted(r for r, f in self.failures.items() if f.kind == "stopped")
        for rank in self.ranks + stopped:  # the first rank to fail first
            failure = self.failures[rank]
            if failure.traceback:
                parts.append(f"--- rank {rank} traceback ---\n{_indent(failure.traceback)}")
            if failure.last_output:
                parts.append(f"--- rank {rank} last output ---\n{_indent(chr(10).join(failure.last_output))}")
        return "\n".join(parts)

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed (raised, died or were stuck), the first to fail first;
        not those the launcher stopped."""
        failed = [r for r, f in self.failures.items() if f.kind != "stopped"]
        first = [r for r in self.order if r in failed]
        return first + sorted(r for r in failed if r not in first)


class RankFailedError(LaunchError):
    """One or more ranks raised an exception or died."""


class RankTimeoutError(LaunchError):
    """The job passed its deadline; the ranks still running were killed."""

    def __init__(self, summary, failures, returned, world_size, timeout: float, order=None):
        self.timeout = timeout
        super().__init__(summary, failures, returned, world_size, order)

    @property
    def running(self) -> list[int]:
        return sorted(r for r, f in self.failures.items() if f.kind == "timeout")
