"""check_destroy, exercise 4's last cell: every worker leaves its process group before it exits."""

from __future__ import annotations

from course.checks import expect, passed, torchrun
from course.errors import rank_list
from graders.torchrun.checks import graded_run, restart_context


def _left_the_group(w: torchrun.Worker) -> bool:
    """Whether the worker's last destroy_process_group() left the default group, and nothing made one again."""
    last = max((i for i, e in enumerate(w.events) if e["event"] == "destroy"), default=None)
    if last is None or not w.events[last].get("default_group_left"):
        return False
    later = [e for e in w.events[last:] if e["event"] == "collectives" and "still_initialized" in e]
    return not any(e["still_initialized"] for e in later)


def check_destroy(script: str = "train.py", *, crash_rank: int | None = None,
                  crash_step: int | None = None, layout: tuple[int, ...] | None = None) -> None:
    """Every worker leaves its process group with dist.destroy_process_group() before it exits.

    Judged in the worker's own process: the probe, with torch's functions bound before the script ran, sees that
    after the call returned the worker no longer held a default process group (and still did not at exit). That
    record is the worker's: on gloo nothing outside it sees the group end while DDP still holds the group (its
    gloo threads and sockets stay until the process ends: measured on torch 2.13), so a script that forges the
    record (and ends with os._exit before anything else is seen) is not told apart. Every other ex4 cell rests on
    evidence from outside the workers; this one states what it can see.
    With ``crash_rank``/``crash_step`` (hidden test): judged on that restart run's last attempt (the workers of
    the first were killed before they could leave)."""
    check = "check_destroy"
    run = graded_run(script, check, crash_rank, crash_step, layout)
    torchrun.require_ok(check, run)
    workers = run.attempt(run.attempts - 1)
    missing = [w.rank for w in workers if not _left_the_group(w)]
    called = [w.rank for w in workers if w.of("destroy")]
    expect(
        not missing,
        check,
        restart_context(run) + f"{rank_list(missing)} never called destroy_process_group: "
        f"{'it' if len(missing) == 1 else 'they'} exited still in the process group"
        if not set(missing) & set(called) else
        f"{rank_list(missing)} still held the default process group at exit "
        "(destroy_process_group was called for another group, or the group was made again)",
        ranks=missing,
        hint="end main() by destroying the process group (destroy_process_group) on every rank: it releases the "
        "process group's sockets and threads (and, with NCCL, avoids warnings and hangs at exit)",
    )
    passed(check)
