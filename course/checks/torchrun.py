"""A script run under real torchrun, as checks judge it: launched once it is written, and why it did not finish.

The launcher (:mod:`course.launcher.torchrun`) runs a script on a layout, crashes a worker when asked and returns
what ran, knowing no check. Here that becomes a check's business: :func:`run_script` and :func:`run_elastic`
fail the check when the script is missing or not written (``vet``), and :func:`failure` reads a
:class:`~course.launcher.torchrun.runner.Run` (each worker's output, exit record and stack, torchrun's own
report) and says who crashed, died or hung, the root cause first, with that worker's own traceback or last
output, as :func:`course.launcher.run_ranks` does for its ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from course.errors import (
    SAME_COLLECTIVES,
    WAITS_FOREVER,
    CheckFailed,
    explain,
    lost_peer,
    rank_list,
    signal_of,
    were,
)
from course.grading.cells import note_ran_on
from course.launcher.fswatch import lone_moves
from course.launcher.torchrun import elastic, runner
from course.launcher.torchrun.elastic import Plan, node, rounds
from course.launcher.torchrun.runner import NODES_TIMEOUT, RESTART_TIMEOUT, Run, Scenario, Worker, describe

__all__ = ["NODES_TIMEOUT", "RESTART_TIMEOUT", "Plan", "Run", "Scenario", "Worker", "describe", "failure",
           "lone_moves", "node", "require_ok", "rounds", "run_elastic", "run_script", "student_traceback"]


def _written(check: str, script: str, vet: Callable[[str], None] | None) -> str:
    """The script's absolute path, once it exists and ``vet`` (a check's "is it written?") accepts its text."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise CheckFailed(check, f"there is no training script at {path}",
                          hint=f"run the %%writefile cell that writes {os.path.basename(path)} first")
    if vet is not None:
        with open(path, "rb") as fh:
            vet(fh.read().decode("utf-8", "replace"))
    return path


def run_script(check: str, script: str, scenario: Scenario, *, layout: tuple[int, ...],
               crash: tuple[int, int] | None = None, on_crash: Callable[[str], object] | None = None,
               vet: Callable[[str], None] | None = None, prelude: str | None = None) -> Run:
    """:func:`course.launcher.torchrun.runner.run_script` for ``check``: a missing or unwritten script fails it.
    ``prelude``: ``"module:function"`` each worker calls with its rank and its secret before the script runs."""
    path = _written(check, script, vet)
    note_ran_on("gloo", hidden=True)  # the runner hides the GPUs: a script's "nccl" cannot start, gloo runs
    return runner.run_script(path, scenario, layout=layout, crash=crash, on_crash=on_crash, prelude=prelude)


def run_elastic(check: str, script: str, *, plan: Plan, input_features: int = 0,
                vet: Callable[[str], None] | None = None,
                on_round: Callable[[str, bool], object] | None = None) -> Run:
    """:func:`course.launcher.torchrun.elastic.run_elastic` for ``check``: a missing or unwritten script fails it."""
    path = _written(check, script, vet)
    note_ran_on("gloo", hidden=True)  # as run_script: every elastic launch runs with the GPUs hidden
    return elastic.run_elastic(path, plan=plan, input_features=input_features,
                               on_round=on_round)


_STUDENT_FRAME_SKIP = ("torchrun_probe.py", "<frozen runpy>")


def student_traceback(text: str) -> str:
    """The last traceback in ``text`` without the probe's and runpy's frames."""
    text = _unprefix(text)  # torch prefixes its workers' stderr lines
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return ""
    lines, kept, skipping = text[start:].splitlines(), [], False
    for line in lines[:80]:
        if line.startswith('  File "'):
            skipping = any(s in line for s in _STUDENT_FRAME_SKIP)
        elif not line.startswith(" "):
            skipping = False
        if not skipping:
            kept.append(line)
        if kept and not line.startswith(" ") and line != lines[0] and not line.startswith("Traceback"):
            break
    return "\n".join(kept)


def _unprefix(text: str) -> str:
    """Drop the "[rank0]: " torch puts in front of its workers' stderr lines."""
    return re.sub(r"(?m)^\[(?:default)?rank\d+\]: ?", "", text)


def _tail(text: str, n: int = 12) -> str:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def _raised(w: Worker) -> bool:
    return "Traceback (most recent call last)" in w.output and not w.of("crash")


def _lost_peer(w: Worker) -> bool:
    """Whether the worker's error is the kind a rank gets when ANOTHER rank failed (a consequence)."""
    tb = student_traceback(w.output)
    return lost_peer(tb.splitlines()[-1] if tb else "")


def _ended_at(w: Worker) -> float:
    return w.events[-1]["t"] if w.events else float("inf")


def _root_cause_pid(run: Run) -> int | None:
    """The pid torchrun's error report names as the first observed failure."""
    found = re.search(r"Root Cause \(first observed failure\):.*?\(pid: (\d+)\)", _unprefix(run.log), re.S)
    return int(found.group(1)) if found else None


def failure(check: str, run: Run, context: str = "") -> CheckFailed:
    """A CheckFailed that says why ``run`` did not finish, the root cause first.

    In order: a worker whose own code raised (not a lost-peer error); a worker that died (a signal,
    os._exit: its exit reason and its own last output); workers stuck at the deadline; workers that
    only lost a peer; then whatever the workers printed. The others are named as consequences."""
    what = run.command
    if not run.workers:
        return CheckFailed(
            check, f"{context}{what} started no worker", hint="run the same command in a terminal to see why",
            detail=_tail(run.log, 20),
        )
    if run.stall is not None:
        v = run.stall
        return CheckFailed(
            check, f"{context}{what} deadlocked: {v.summary}", ranks=sorted(v.lines), hint=v.hint,
            detail=f"where each worker was when the grader stopped the run (after {run.elapsed:.1f} s):\n{v.lined_up}",
        )
    last = run.attempt(run.attempts - 1)  # the last attempt: in the restart run, attempt 0 fails by design
    raised = sorted((w for w in last if _raised(w)), key=_ended_at)
    causes = [w for w in raised if not _lost_peer(w)]
    dead = [w for w in last if _died(w, run)]
    stuck = [w for w in last if run.timed_out and not w.exited and w not in dead]
    if causes:
        return _raised_failure(check, f"{context}{what}", causes[0], last, run, _first_then_affected(causes[0], last))
    if dead:
        # torchrun stops the other workers with SIGTERM once one failed: those are consequences
        primary = ([w for w in dead if not _raised(w) and "SIGTERM" not in _exit_reason(w, run)]
                   or [w for w in dead if not _raised(w)] or dead)
        root = _root_cause_pid(run)
        first = next((w for w in primary if w.pid == root), None) or min(primary, key=_ended_at)
        tb = student_traceback(first.output)
        return CheckFailed(
            check,
            f"{context}{what} failed: {first.name} died ({_exit_reason(first, run)})" + _consequences(first, last, run),
            ranks=_first_then_affected(first, last),
            hint=("a worker killed by a signal usually crashed inside torch (SIGABRT, SIGSEGV) or was killed for "
                  "memory (SIGKILL); its own last output is below: run the same torchrun command in a terminal "
                  "to see all of it"),
            detail=f"{first.name}'s last output:\n{tb or _tail(_unprefix(first.output), 12) or '(nothing)'}",
        )
    if stuck:
        detail = "\n".join(f"{w.name} was at:\n{_student_stack(w.stack) or _tail(w.output, 8)}" for w in stuck)
        return CheckFailed(
            check,
            f"{context}{what} did not finish within {run.timeout:g} s; "
            f"{were([w.rank for w in stuck])} still running (stuck)",
            ranks=[w.rank for w in stuck],
            hint=f"{WAITS_FOREVER} another rank never reached, e.g. a collective inside `if rank == 0:`, or an init_process_group "
            "given a wrong rank or world_size; let init_process_group read them from the environment",
            detail=detail or _tail(run.log, 20),
        )
    left = [w for w in last if _finished(w)]
    if raised and left:  # the others only lost their peer: the root cause is a worker that left too early
        return CheckFailed(
            check,
            f"{context}{what} failed: {_names(left)} finished while {rank_list([w.rank for w in raised])} still "
            "waited in a collective (then they lost their peer)",
            ranks=sorted({w.rank for w in left + raised}),
            hint=("every rank must run the same steps and call the same collectives: a rank that runs fewer steps "
                  "(uneven data, a loop that ends early) or skips a collective leaves its peers waiting"),
            detail=student_traceback(raised[0].output),
        )
    if raised:
        return _raised_failure(check, f"{context}{what}", raised[0], last, run, sorted({w.rank for w in raised}))
    if run.timed_out and run.stranded:  # several agents, each waiting for the other
        return CheckFailed(
            check,
            f"{context}{what} never ended: every worker had ended, and the torchrun agents went on waiting for "
            f"each other (the grader stopped them after {run.elapsed:.0f} s, with no worker left on any node)",
            ranks=sorted({w.rank for w in last if w.exited and not w.of("crash")}),
            hint="a node whose workers all finished waits for the other nodes at the exit, while a node whose "
            "worker died waits for every node to meet again: workers that finish although another rank died "
            "did not wait on it. Every rank must take part in each step's collectives (DDP's all-reduce), so a "
            "dead rank stops them all and torchrun restarts every node",
            detail=_tail(run.log, 20),
        )
    if run.timed_out:  # the workers ended, the agents did not
        return CheckFailed(
            check,
            f"{context}{what} did not finish within {run.timeout:g} s: every worker had ended, "
            "but torchrun did not (see torchrun's report below)",
            hint="run the same command in a terminal; if a worker was killed by a signal (SIGABRT, SIGKILL), "
            "look for an error it printed just before, or for a machine out of memory",
            detail=_tail(run.log, 20),
        )
    talked = [w for w in last if _unprefix(w.output).strip()]
    detail = "\n".join(f"{w.name} printed:\n{_tail(_unprefix(w.output), 8)}" for w in talked[:2])
    return CheckFailed(
        check,
        f"{context}{what} failed (exit codes {run.returncodes}) without a Python traceback",
        ranks=[w.rank for w in talked],
        hint=_hint_for(detail) or "read each rank's last output below; run the script with torchrun in a terminal "
        "to see all of it",
        detail=detail or _tail(run.log, 20),
    )


def _raised_failure(check: str, run_name: str, first: Worker, last: list[Worker], run: Run,
                    ranks: list[int]) -> CheckFailed:
    """``first``'s own exception leads: its message, its traceback, and what the others did after it."""
    tb = student_traceback(first.output)
    message = tb.splitlines()[-1] if tb else "an error"
    return CheckFailed(
        check,
        f"{run_name} failed: {first.name} raised {message}" + _consequences(first, last, run),
        ranks=ranks,
        hint=_hint_for(message) or "read the traceback below (it starts in your script)",
        detail=tb,
    )


def _first_then_affected(first: Worker, last: list[Worker]) -> list[int]:
    """The failing worker's rank, then those of the attempt's workers that did not finish because of it."""
    return [first.rank] + sorted({w.rank for w in last if w is not first and not _finished(w)} - {first.rank})


def _names(workers: list[Worker]) -> str:
    return ", ".join(w.name for w in workers)


def _finished(w: Worker) -> bool:
    return w.exited and not _raised(w)


def _consequences(first: Worker, last: list[Worker], run: Run) -> str:
    """What the other workers of the attempt did after ``first`` failed: the consequences, named."""
    parts = []
    lost = sorted(w.rank for w in last if w is not first and _raised(w))
    waiting = sorted(w.rank for w in last if w is not first and not w.exited and not _raised(w))
    if lost:
        parts.append(f"{rank_list(lost)} failed after it (lost {'its' if len(lost) == 1 else 'their'} peer)")
    if waiting:
        parts.append(f"{were(waiting)} {'left waiting' if run.timed_out else 'stopped by torchrun'}")
    return f"; then {' and '.join(parts)}" if parts else ""


def _died(w: Worker, run: Run) -> bool:
    """Whether a worker ended without finishing Python (no exit record), other than by the grader's own crash."""
    if w.exited:
        return False
    if run.timed_out:
        return bool(run.alive_at_deadline) and w.pid not in run.alive_at_deadline
    # a job that ended: a worker of the last attempt without an exit record was killed
    return w.attempt == run.attempts - 1 and not run.ok


def _exit_reason(w: Worker, run: Run) -> str:
    """What torchrun said about the worker's end: the signal or the exit code, from its failure report."""
    log = _unprefix(run.log)
    found = re.search(rf"Signal (\d+) \((\w+)\) received by PID {w.pid}\b", log)
    if found:
        return f"killed by signal {found.group(2)}"
    found = re.search(rf"exitcode\s*:\s*(-?\d+) \(pid: {w.pid}\)", log)
    if found:
        code = int(found.group(1))
        return f"killed by signal {signal_of(code).removeprefix('signal ')}" if code < 0 else f"exit code {code}"
    if "terminate called" in w.output:
        return "aborted in C++ (terminate called)"
    return "no exit record: killed, or it called os._exit"


def _hint_for(message: str) -> str | None:
    known = explain(message)
    if known:
        return known
    if "NotImplementedError" in message:
        return "write train.py first: the answer parts of the %%writefile cell still raise NotImplementedError"
    if re.search(r"--local[-_]rank", message):
        return "torchrun passes no --local_rank argument: read int(os.environ['LOCAL_RANK']) instead"
    if "unrecognized arguments" in message or "arguments are required" in message:
        return "the grader runs `train.py --out OUT --ckpt CKPT`: keep the given argument parser as it is"
    if re.search(r"KeyError: '(RANK|LOCAL_RANK|WORLD_SIZE)'", message):
        return "torchrun sets RANK, LOCAL_RANK and WORLD_SIZE: read them with os.environ"
    if "Connection" in message or "Timed out" in message:
        return ("this rank lost a peer while in a collective: another rank crashed or skipped the collective "
                f"({SAME_COLLECTIVES})")
    return None


def _student_stack(stack: str) -> str:
    lines = [line for line in stack.splitlines() if not any(s in line for s in _STUDENT_FRAME_SKIP)]
    return "\n".join(lines[:12])


def require_ok(check: str, run: Run, context: str = "") -> None:
    """Fail ``check`` with :func:`failure` unless ``run`` finished cleanly."""
    if not run.ok:
        raise failure(check, run, context)
