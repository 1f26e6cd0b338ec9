"""The project's errors, in one place. Their text is written for the person who reads it (a student, an instructor).

* :class:`CourseError`: the base of every error the engine raises on purpose; the
  CLI (:mod:`course.cli`) turns it into one line, never a traceback;
* :class:`LaunchError` and its two kinds: a multi-rank job did not complete (the launcher);
* :class:`NotebookError`: a notebook that cannot be read or graded (grading);
* :class:`CheckFailed`: a check found a mistake in a student's code (the check API).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

#: how a rank ended when it did not return: it raised, it died without a Python exception,
#: the launcher stopped it after another rank failed, or it was still running at the deadline
RankEnd = Literal["raised", "exited", "stopped", "timeout"]


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 1', 'ranks 0, 2' or 'no rank', for messages."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def were(ranks: Iterable[int]) -> str:
    """'rank 1 was' or 'ranks 0, 2 were'."""
    ranks = sorted(set(ranks))
    return rank_list(ranks) + (" was" if len(ranks) == 1 else " were")


#: (text in an error message, what it means and what to do): misconfigurations students really make
KNOWN_MISTAKES = (
    ("initialize the default process group twice",
     "init_process_group was called twice in one process: join once per process (in setup()); in a check, the "
     "grader has already joined the job before calling your function, so your function must not join again"),
    ("Default process group has not been initialized",
     "a collective (or get_rank/get_world_size, or DDP) ran before init_process_group: join the job first "
     "(dist.init_process_group(backend)), then communicate"),
    ("device_ids and output_device arguments only work with",
     "DDP got device_ids for a model on the CPU: pass device_ids=[local_rank] only when the model is on that GPU "
     "(model.to(device) first); on the CPU (gloo) leave device_ids out"),
    ("Duplicate GPU detected",
     "two ranks use the same GPU under NCCL: select GPU LOCAL_RANK in each rank (torch.cuda.set_device(local_rank)) "
     "before init_process_group, and run at most one rank per GPU"),
    ("Expected all tensors to be on the same device",
     "a tensor and the model are on different devices: move each batch to the rank's device (x.to(device)) and "
     "the model before wrapping it in DDP"),
)


def explain(message: str) -> str | None:
    """What a known misconfiguration's error means and what to do, or None."""
    for text, advice in KNOWN_MISTAKES:
        if text in message:
            return advice
    return None


#: what a rank's error says when a peer closed the connection under it (the peer returned or died)
CONNECTION_LOST = ("Connection closed", "Connection reset", "Broken pipe")
#: what a rank's error says when a PEER is gone (it closed the connection, or never answered within the
#: process group's timeout): the rank failed because of another one
LOST_PEER = (*CONNECTION_LOST, "Timed out", "timed out", "connectFullMesh")


def lost_peer(text: str) -> bool:
    """Whether ``text`` (an error, a traceback) is what a rank says when it lost a peer (:data:`LOST_PEER`)."""
    return any(words in text for words in LOST_PEER)


def connection_lost(text: str) -> bool:
    """Whether ``text`` says a peer closed the connection under this rank (:data:`CONNECTION_LOST`): the
    launcher's test for a failure that is a consequence of another rank's."""
    return any(words in text for words in CONNECTION_LOST)


# --------------------------------------------------------------------------- advice, written once

#: the rule most distributed mistakes break, as every hint words it
SAME_COLLECTIVES = "every rank must call the same collectives in the same order"
#: where a rank that never returns usually waits (how a hung job's hint begins)
WAITS_FOREVER = "a rank that waits forever is usually in a collective (all_reduce, barrier, DDP backward)"
#: a rank that failed because its peer had gone
LOST_PEER_ADVICE = ("this rank lost its connection to a peer, which usually means another rank had already returned "
                    f"or died while this one waited in a collective: {SAME_COLLECTIVES}")
#: the ranks called different collectives, or one with tensors of different sizes
MISMATCH_ADVICE = (f"{SAME_COLLECTIVES}, with tensors of the same shape and dtype: look for a collective inside "
                   "`if rank == ...:` or tensors whose size depends on the rank")


def signal_of(code: int) -> str:
    """The signal that ended a process with exit status ``code`` < 0: 'SIGKILL', or 'signal 42' unnamed."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int | None) -> str:
    """How a process that left no Python traceback ended, from its exit status."""
    if code is None:
        return "still running"
    if code < 0:
        name = signal_of(code)
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exited with code {code} without a Python traceback (os._exit, a crash in C code, or a killed process)"


#: exit status of every ``ddp-course`` verb: all done; nothing done (a usage or input error, one line on stderr);
#: done in part (some submissions could not be filed, graded or written: the verb lists which and why)
EXIT_OK, EXIT_ERROR, EXIT_PARTLY = 0, 1, 2


class CourseError(Exception):
    """An error the engine raises on purpose; ``str()`` says what happened and what to do."""

    exit_code = EXIT_ERROR


class PartlyDone(CourseError):
    """A verb did what it could and has already listed what it could not do; exit status :data:`EXIT_PARTLY`."""

    exit_code = EXIT_PARTLY


def unknown_names(kind: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """"unknown student(s): bob (did you mean bobby?); known: alice, bobby" for an input error."""
    import difflib

    known = sorted(set(known))
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"unknown {kind}(s): {', '.join(parts)}; known: {', '.join(known) or 'none yet'}"


@dataclass
class RankFailure:
    """What one rank left behind when it did not return normally."""

    rank: int
    #: "raised", "exited" (died without a Python exception), "stopped" (killed by
    #: the launcher after another rank failed) or "timeout" (still running at the deadline)
    kind: RankEnd
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
    return "\n".join(prefix + line for line in str(text).rstrip().splitlines())


class LaunchError(CourseError, RuntimeError):
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


class RankStallError(RankTimeoutError):
    """The ranks deadlocked (found by :mod:`course.launcher.stall` before the deadline); they were killed.

    ``verdict``: each rank lined up with the collective it waits in and its source line, and a hint."""

    def __init__(self, summary, failures, returned, world_size, timeout: float, order=None, verdict=None):
        self.verdict = verdict
        super().__init__(summary, failures, returned, world_size, timeout, order)


class NotebookError(CourseError):
    """A notebook that cannot be read or graded; ``str()`` is one line for the user."""


#: the levels of a failed check's message, as a tutor escalates: 1 what is wrong (the check, the ranks, what was
#: expected, what happened), 2 the idea the check tests and the lesson section that teaches it, 3 where in the
#: student's code it breaks (the ``try:`` line). No level shows solution code.
HINT_LEVELS = 3
#: course.envnames.CHECK_PACKAGES_ENV, spelt out: this module imports nothing of the project
CHECK_PACKAGES_ENV = "DDP_COURSE_CHECK_PACKAGES"
#: the failures the notebook showed, oldest first (:meth:`CheckFailed._render_traceback_`), for ``course.hint()``
SHOWN: list[CheckFailed] = []


def _raising_package() -> str | None:
    """The check package (``graders.ddp_basics``) of the outermost frame on the stack that is in one (under
    ``graders`` or a root named in ``DDP_COURSE_CHECK_PACKAGES``): the package whose check the test cell called."""
    roots = {"graders", *(name.strip() for name in os.environ.get(CHECK_PACKAGES_ENV, "").split(","))}
    found, frame = None, sys._getframe(1)
    while frame is not None:
        top, _, rest = str(frame.f_globals.get("__name__", "")).partition(".")
        if top in roots and rest:
            found = f"{top}.{rest.split('.')[0]}"
        frame = frame.f_back
    return found


class CheckFailed(AssertionError):
    """A check found a mistake in the student's code.

    ``FAILED check_x [rank 1]: problem``, then what was expected, what happened, the idea and the lesson
    section that teaches it (``concept``, ``lesson``: level 2), what to try (``hint``: level 3), and a detail
    (a traceback from the student's code, where stuck ranks waited: evidence, shown at every level).
    :meth:`render` gives one level (:data:`HINT_LEVELS`); ``str()`` is every level, for logs and tests; what a
    student sees (the notebook, the verifier's verdict, the feedback, ``ddp-course check``) starts at level 1.
    ``hung``: the failure is a job that did not finish (past its deadline, or deadlocked), not a crash
    (set by :func:`course.checks.run`). ``package``: the check package that raised it (``graders.ddp_basics``).
    """

    hung: bool = False

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
        self.package = _raising_package()
        self.concept: str | None = None  # level 2, filled in from the package's concepts by the code that shows it
        self.lesson: str | None = None
        super().__init__(self.render())

    @property
    def not_written(self) -> bool:
        """The answer is still nbgrader's stub: level 1 says so, and there is nothing more to ask."""
        return "not written yet" in self.problem

    @property
    def deepest(self) -> int:
        """The last level that adds something to the one before."""
        if self.not_written:
            return 1
        if self.hint:
            return HINT_LEVELS
        return 2 if self.concept or self.package else 1

    def ask(self, level: int = 1) -> str:
        """How a student asks for the level after ``level``, in the notebook and on the command line."""
        notebook = f"{self.package.rpartition('.')[2]}.ipynb" if self.package else "NOTEBOOK"
        what = "a hint" if level == 1 else "where your code breaks it"
        return (f'for {what}, run course.hint("{self.check}") in the notebook, or '
                f"ddp-course check {notebook} --hint {self.check}")

    def render(self, level: int | None = None) -> str:
        """The message up to ``level`` (1 to :data:`HINT_LEVELS`, at most :attr:`deepest`), with a line saying how
        to ask for the next; every level ends with the detail. ``None``: every part there is (``str()``)."""
        full = level is None
        level = HINT_LEVELS if level is None else max(1, min(level, self.deepest))
        if level == 2 and not (self.concept or self.lesson):  # a package without concepts: on to what to try
            level = self.deepest
        where = f" [{rank_list(self.ranks)}]" if self.ranks else ""
        lines = [f"FAILED {self.check}{where}: {self.problem}"]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.got is not None:
            lines.append(f"  got:      {self.got}")
        if level >= 2 and self.concept:
            lines.append(f"  idea:     {self.concept}")
        if level >= 2 and self.lesson:
            lines.append(f"  read:     {self.lesson}")
        if level >= 3 and self.hint:
            lines.append(f"  try:      {self.hint}")
        if not full and level < self.deepest:
            lines.append(f"  more:     {self.ask(level)}")
        if self.detail:
            lines.append(_indent(self.detail, "  | "))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def _render_traceback_(self) -> list[str]:
        # IPython renders this instead of a traceback through the graders' frames: level 1, remembered for
        # course.hint(), which gives the next.
        SHOWN[:] = [err for err in SHOWN if err is not self][-31:] + [self]
        return self.render(1).splitlines()
