"""check_restart_resume and try_restart, exercise 4: a rank killed mid-training, the job restarted by torchrun,
resumed from the checkpoint (judged by the final weights, after the grader shifted the checkpoint's while the job
was down: only a job that reads it carries the shift to the end)."""

from __future__ import annotations

from course.checks import CheckFailed, expect, passed, torchrun
from graders.common.torchrun_model import EPOCHS, STEPS_PER_EPOCH, compare_weights, expected_weights, replayed_by_hand
from graders.torchrun.checks import (
    ATOL,
    CRASH_RANK,
    CRASH_STEP,
    _crash_context,
    _final_weights,
    _restart_run,
    data_of,
)


def _restart_table(run: torchrun.Run) -> str:
    """What each rank did in each attempt of the restart run, one line a worker (the student's view of it)."""
    lines = []
    for n in range(run.attempts):
        lines.append(f"attempt {n}" + (" (the first launch)" if n == 0 else " (torchrun's restart)") + ":")
        for w in run.attempt(n):
            steps = len(w.of("step"))
            loaded = any(e.get("path") == run.ckpt_path for e in w.of("load") + w.of("open"))
            ended = ("killed by the grader" if w.of("crash") else
                     "exited" if w.of("exit") else "stopped by torchrun")
            lines.append(f"  rank {w.rank}: {'loaded the checkpoint' if loaded else 'no checkpoint loaded'}, "
                         f"{steps} optimizer step(s) (~{steps / STEPS_PER_EPOCH:g} epoch(s)), {ended}")
    if isinstance(run.final, dict):
        crash_epoch = (run.crash[1] - 1) // STEPS_PER_EPOCH if run.crash else 0
        shifted = run.crash_note is not None
        resume = (crash_epoch, crash_epoch, True, run.crash_note)
        resumed = expected_weights(run.world_size, None, resume, data_of(run, resume))
        diff = compare_weights(run.final, resumed)
        what = "a run resumed from the checkpoint" + (" (the grader shifted its weights)" if shifted else "")
        verdict = (f"equal to {what}" if diff is not None and diff <= ATOL else
                   "different keys or shapes" if diff is None else f"differs from {what} by {diff:.3g}")
        lines.append(f"final.pt: {verdict}")
    else:
        lines.append("final.pt: " + ("not written" if run.final is None else run.final))
    return "\n".join(lines)


def try_restart(script: str = "train.py", crash_rank: int = CRASH_RANK,
                crash_step: int = CRASH_STEP, layout: tuple[int, ...] | None = None) -> torchrun.Run:
    """Run the grader's crash-and-restart launch and print, per attempt, what each rank did.

    The same launch :func:`check_restart_resume` grades (torchrun --standalone --nproc_per_node=2
    --max-restarts=1, or two agents with ``layout``'s workers; the worker of ``crash_rank`` is killed once
    after optimizer step ``crash_step``)."""
    run = _restart_run(script, "try_restart", crash_rank, crash_step, layout)
    crash = run.crash
    print(f"{run.command}: {_crash_context(crash).rstrip('; ')}; "
          f"{'finished' if run.ok else 'FAILED'} in {run.elapsed:.1f} s")
    print(_restart_table(run))
    if not run.ok:
        print(torchrun.failure("try_restart", run))
    return run


def _replayed(run: torchrun.Run, final: dict, crash_epoch: int) -> bool:
    """Whether rank 0's final weights are those of a restarted job that recomputed the epochs before the crash
    instead of loading them: through DDP (every epoch on the restarted workers' batches), or by hand in every
    worker (:func:`replayed_by_hand`)."""
    last = data_of(run)
    return any(compare_weights(final, reference) <= ATOL for reference in (
        expected_weights(run.world_size, data=last), replayed_by_hand(run.world_size, crash_epoch, last[0])))


def check_restart_resume(script: str = "train.py", *, crash_rank: int = CRASH_RANK,
                         crash_step: int = CRASH_STEP, layout: tuple[int, ...] | None = None) -> None:
    """A rank dies once mid-training; with --max-restarts=1 the job resumes from the checkpoint and ends right."""
    check = "check_restart_resume"
    run = _restart_run(script, check, crash_rank, crash_step, layout)
    crash = run.crash
    context = _crash_context(crash)
    table = _restart_table(run)
    crashed = any(w.of("crash") for w in run.workers)
    if not crashed:
        if not run.ok:
            raise torchrun.failure(check, run, "before the injected crash: ")
        steps = max((len(w.of("step")) for w in run.attempt(0) if w.rank == crash_rank), default=0)
        raise CheckFailed(
            check,
            f"the grader could not crash rank {crash_rank}: it took only {steps} optimizer step(s), and the crash "
            f"comes after step {crash_step} of {EPOCHS * STEPS_PER_EPOCH}",
            ranks=[crash_rank],
            hint=f"every rank trains all {EPOCHS} epochs of {STEPS_PER_EPOCH} steps, in step with the others (DDP), "
            "calling optimizer.step() of a torch.optim optimizer once per step",
            detail=table,
        )
    if not run.ok:
        raise torchrun.failure(check, run, context + "after the restart, ")
    restarted = run.attempt(1)
    expect(bool(restarted), check, context + "torchrun never restarted the workers",
           hint="the grader runs torchrun with --max-restarts=1; the job must not end before that", detail=table)
    total = EPOCHS * STEPS_PER_EPOCH
    crash_epoch = (crash_step - 1) // STEPS_PER_EPOCH
    resumed_steps = (EPOCHS - crash_epoch) * STEPS_PER_EPOCH
    # one worker may read the checkpoint and hand its state to the others (a broadcast): the job must have read it,
    # and no restarted worker may train from the start again (the final weights then judge where they came from)
    read = [w for w in restarted if any(e.get("path") == run.ckpt_path for e in w.of("load") + w.of("open"))]
    for w in restarted:
        steps = len(w.of("step"))
        if steps >= total or not read:
            raise CheckFailed(
                check,
                context + f"after the restart {w.name} "
                + ("never read the checkpoint (no restarted worker did) and " if not read else "")
                + f"trained {steps} steps: it started from epoch 0 again",
                ranks=[w.rank],
                expected=f"load the checkpoint of epoch {crash_epoch - 1} and train only epochs "
                f"{crash_epoch}..{EPOCHS - 1} "
                f"({resumed_steps} steps)",
                got=f"{steps} steps",
                hint="at start-up, if os.path.exists(args.ckpt): load it (map_location='cpu'; on every rank, or on "
                "one that sends it to the others), restore the model and optimizer state, and start at the saved "
                "epoch + 1",
                detail=table,
            )
    final = _final_weights(check, run)
    # an honest resume: the uninterrupted run's state at the crash's epoch, shifted as the grader shifted the
    # checkpoint while the job was down (run.crash_note: the secret seed; None where the file could not be shifted)
    resume = (crash_epoch, crash_epoch, True, run.crash_note)
    reference = expected_weights(run.world_size, None, resume, data_of(run, resume))
    diff = compare_weights(final, reference)
    if diff is None or diff > ATOL:
        steps = len(restarted[0].of("step")) if restarted else 0
        replayed = run.crash_note is not None and _replayed(run, final, crash_epoch)
        if replayed:
            hint = ("load the model and the optimizer state from CKPT after a restart, and train on from there: "
                    "never recompute the epochs before it (the grader changed the weights in the checkpoint while "
                    "the job was down, and a job that resumes from it carries that change to the end)")
        elif steps != resumed_steps:
            hint = (f"after the restart rank 0 trained {steps} steps, not {resumed_steps}: resume at the epoch after "
                    "the one saved in the checkpoint (off by one?)")
        else:
            hint = ("the resumed run took the right number of steps but ended elsewhere: restore the optimizer "
                    "state too (SGD momentum lives there), on every rank, and save the state after the epoch's "
                    "last step")
        raise CheckFailed(
            check,
            context + ("the final weights are those of a run that never resumed from the checkpoint: the restarted "
                       "job recomputed the epochs before the crash instead of loading them" if replayed else
                       f"the final weights differ from a {run.world_size}-rank run resumed from the checkpoint "
                       + (f"(max |diff| {diff:.3g})" if diff is not None else "(different keys or shapes)")),
            ranks=[0],
            expected=f"equal within {ATOL:g} to a run that loads the checkpoint as the grader left it "
            "(check_ddp_training judges the training itself; fix that first if it fails)",
            got=f"max |diff| = {diff:.3g}" if diff is not None else sorted(final),
            hint=hint,
            detail=table,
        )
    passed(check)
