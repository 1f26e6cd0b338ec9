"""Checks for exercise 4: a training script launched with torchrun.

Every check launches the student's script with real torchrun (``python -m
torch.distributed.run``) through :mod:`course.checks.torchrun`, whose probe records
what each worker really did (its environment, checkpoint writes and renames,
optimizer steps, ``destroy_process_group``). A launch costs several seconds, so
a script is launched at most twice and every check reads those two runs
(cached by the script's content):

* ``nodes``: two torchrun agents on this machine joined by a c10d rendezvous
  (``--nnodes=2``, 1 and 2 workers: world size 3, and LOCAL_RANK != RANK on
  the second node), uninterrupted;
* ``restart``: ``--standalone --nproc_per_node=2 --max-restarts=1``; the worker
  of rank 1 dies once, right after its 5th optimizer step (in epoch 2 of 0-3), so
  the job ends right only if the script resumes from its last checkpoint.

The hidden tests run the restart launch once more, on other nodes and with another crash: two agents joined
by a c10d rendezvous with one worker each (``layout=(1, 1)``: LOCAL_RANK is 0 on both, RANK 1 on the second;
both agents restart their workers), rank 0 killed after its step 3. Every check but check_standalone_ranks reads that run too
(``crash_rank``/``crash_step``/``layout``, no launch of its own): the workers' ranks on both nodes (the
restarted ones too), who writes the checkpoint and how, the weights, the group left at exit. The standalone
rank test has no hidden variant: on two nodes it would judge the ranks check_multinode_ranks judges, and a
RANK/LOCAL_RANK mix-up would lose both cells. (Two agents of
2 + 1 workers cost 2 s more, which takes the notebook's grading past its 30 s: every worker's first
optimizer pays ~1 s importing torch._dynamo.)

GPUs are hidden from the job (it trains on gloo everywhere), and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` works around pytorch#135712 (a
restarted ``--standalone`` job failing in "Gloo connectFullMesh").
"""

from __future__ import annotations

import os

import torch

from course import checks
from course.checks import CheckFailed, expect, passed, torchrun
from course.errors import rank_list
from graders.common.torchrun_model import (  # noqa: F401 - the given parts and the reference, as graders.torchrun.checks has named them
    EPOCHS,
    LR,
    MOMENTUM,
    STEPS_PER_EPOCH,
    compare_weights,
    expected_weights,
    get_batch,
    make_model,
    replayed_by_hand,
    secrets_of,
    shift_checkpoint,
    top_level_stub,
)
from graders.torchrun.probe import atomic_from_the_probe, commits_of, kernel_commits, writers_from_the_kernel, writes_of

ATOL = 1e-6

# The launches (the exercise's settings; the launcher knows none of them)
CRASH_RANK = 1
CRASH_STEP = 5  # rank 1's 5th optimizer step: epochs 0 and 1 are checkpointed, epoch 2 has begun
NODES_WORKERS = (1, 2)  # workers per torchrun agent in the 2-node run
RESTART_WORKERS = (2,)  # the restart run's layout: one standalone agent with 2 workers
#: what each worker of a graded run does before the script: its own batches carry its secret offset
PRELUDE = "graders.common.torchrun_model:install"


def data_of(run: torchrun.Run, resume: tuple | None = None, only: int | None = None) -> tuple:
    """The ``data`` of :func:`expected_weights` for ``run``: the workers' secrets before and after the restart
    (``resume``), or the last launch's for a run judged as trained from the start (``resume`` None). ``only``:
    that rank's secrets alone (every other rank's batches as get_batch gives them in any process: what that
    rank's worker computes of them by itself)."""
    data = [*secrets_of(run.forks, run.world_size)]
    data = data[1:] if resume is None else data
    return tuple(tuple(s if only is None or rank == only else None for rank, s in enumerate(secrets))
                 for secrets in data)


# --------------------------------------------------------------------------- the checks


def _run_script(script: str, scenario: torchrun.Scenario, check: str, **kwargs) -> torchrun.Run:
    """:func:`torchrun.run_script`, once train.py is written (no nbgrader stub left in it, nor in a ``main``)."""
    def vet(source: str) -> None:
        checks.require_written_source(check, source, "train.py", names=("main",))
        if top_level_stub(source):
            raise CheckFailed(check, "train.py is not written yet: the script still runs nbgrader's "
                              "`raise NotImplementedError()`",
                              hint="write the script below `# ---- yours ----` to the specification (replace "
                              "`raise NotImplementedError()`), run that cell, then this one")

    kwargs.setdefault("layout", NODES_WORKERS)
    return torchrun.run_script(check, script, scenario, vet=vet, prelude=PRELUDE, **kwargs)


def _check_reports(check: str, run: torchrun.Run, world_size: int) -> None:
    """Every worker reported the rank, local_rank and world_size torchrun gave it."""
    if not run.workers:
        raise torchrun.failure(check, run)
    mistakes, missing = [], []
    last = run.attempts - 1
    for w in run.workers:
        if w.of("crash"):
            continue
        report = run.reports.get(w.pid)
        if report is None:
            if w.attempt == last:  # workers of an attempt that torchrun stopped may not have got that far
                missing.append(w)
            continue
        if not isinstance(report, dict):
            mistakes.append((w, f"its report is {report}", None))
            continue
        for key, real in (("rank", w.rank), ("local_rank", w.local_rank), ("world_size", w.world_size)):
            got = report.get(key)
            if got != real or isinstance(got, bool):
                mistakes.append((w, f"{key}={got!r}, but torchrun set {key.upper()}={real}", _report_hint(key, got, w)))
    if missing and not mistakes:
        if not run.ok and any(not run.reports.get(w.pid) for w in missing):
            raise torchrun.failure(check, run, "no report from " + rank_list([w.rank for w in missing]) + ": ")
        raise CheckFailed(
            check,
            f"{rank_list([w.rank for w in missing])} wrote no report",
            ranks=[w.rank for w in missing],
            hint="every worker writes OUT/report-<its pid>.json early, before anything that could fail or wait on "
            "the other workers",
        )
    if mistakes:
        first = mistakes[0]
        raise CheckFailed(
            check,
            f"{first[0].name} reported {first[1]}",
            ranks=[w.rank for w, _, _ in mistakes],
            expected=f"rank, local_rank, world_size = RANK, LOCAL_RANK, WORLD_SIZE from torchrun's environment "
            f"(world size {world_size})",
            got="; ".join(f"rank {w.rank}: {what}" for w, what, _ in mistakes[:4]),
            hint=first[2] or "read all three from os.environ: torchrun sets them for every worker",
        )


def _report_hint(key: str, got, w: torchrun.Worker) -> str | None:
    if key == "local_rank" and got == w.rank and w.rank != w.local_rank:
        return ("you used RANK as the local rank: RANK is global (0..WORLD_SIZE-1 across all machines), "
                "LOCAL_RANK is the index on this machine (the one to pick a GPU with): "
                "local_rank = int(os.environ['LOCAL_RANK'])")
    if key == "rank" and got == w.local_rank and w.rank != w.local_rank:
        return ("you used LOCAL_RANK as the global rank: on a second machine LOCAL_RANK starts at 0 again; "
                "rank = int(os.environ['RANK'])")
    if key == "local_rank" and got in (0, -1, None):
        return ("torchrun passes no --local_rank argument (an argparse default of 0 is wrong on every other "
                "worker): local_rank = int(os.environ['LOCAL_RANK'])")
    if key == "world_size":
        return "world_size = int(os.environ['WORLD_SIZE']): never hard-code it"
    return None


def graded_run(script: str, check: str, crash_rank: int | None, crash_step: int | None,
                layout: tuple[int, ...] | None = None) -> torchrun.Run:
    """The run a check judges: the 2-node run, or (a hidden test, ``crash_rank``/``crash_step`` given) the
    restart run with that crash and ``layout``, the launch :func:`check_restart_resume` makes for it: no
    launch of its own."""
    if crash_rank is None and crash_step is None and layout is None:
        return _run_script(script, "nodes", check)
    return _restart_run(script, check, CRASH_RANK if crash_rank is None else crash_rank,
                        CRASH_STEP if crash_step is None else crash_step, layout)


def _restart_run(script: str, check: str, crash_rank: int, crash_step: int,
                 layout: tuple[int, ...] | None) -> torchrun.Run:
    layout = tuple(layout or RESTART_WORKERS)
    crash = _valid_crash(crash_rank, crash_step, sum(layout))
    return _run_script(script, "restart", check, crash=crash, layout=layout, on_crash=shift_checkpoint)


def restart_context(run: torchrun.Run) -> str:
    """What a check on the restart run says first: the crash (empty for the 2-node run)."""
    return _crash_context(run.crash) if run.scenario == "restart" and run.crash else ""


def check_standalone_ranks(script: str = "train.py", *, crash_rank: int = CRASH_RANK,
                           crash_step: int = CRASH_STEP, layout: tuple[int, ...] | None = None) -> None:
    """Under ``torchrun --standalone --nproc_per_node=2`` every worker reads its rank, local rank and world size.

    It reads the restart run with the crash at (``crash_rank``, ``crash_step``) and ``layout``, the launch
    :func:`check_restart_resume` makes for the same crash: the workers torchrun restarted report too."""
    check = "check_standalone_ranks"
    run = _restart_run(script, check, crash_rank, crash_step, layout)
    _check_reports(check, run, world_size=run.world_size)
    passed(check)


def check_multinode_ranks(script: str = "train.py", *, crash_rank: int | None = None, crash_step: int | None = None,
                          layout: tuple[int, ...] | None = None) -> None:
    """Two torchrun agents (2 "nodes", world size 3): LOCAL_RANK and RANK differ on the second node.

    With ``crash_rank``/``crash_step``/``layout`` (hidden test): judged on that restart run on two nodes, the
    workers of both rounds (a restarted worker may hold another rank, on the other node)."""
    check = "check_multinode_ranks"
    run = graded_run(script, check, crash_rank, crash_step, layout)
    if len(run.layout) < 2:
        raise ValueError(f"{check} judges a run on several nodes, not {run.command}")
    _check_reports(check, run, world_size=run.world_size)
    passed(check)


def check_checkpoint_rank0(script: str = "train.py", *, crash_rank: int | None = None,
                           crash_step: int | None = None, layout: tuple[int, ...] | None = None) -> None:
    """Only rank 0 writes the checkpoint (once after every epoch) and the final weights.

    Who wrote is judged from outside the workers: the launcher asks the kernel, at each inotify event of the
    checkpoint's folder and OUT, which worker holds a file there open for writing (``/proc/<pid>/fd``, the worker's
    RANK from the environment torchrun gave it); a rank other than 0 seen so fails. How many times the checkpoint
    and final.pt were put in place is the kernel's count too: more than one writer makes (once an epoch, final.pt
    once) fails, fewer than one per epoch fails (except where the checkpoint was moved in from a folder the launcher
    did not watch: the kernel may have kept two such moves as one, and rank 0's record says how often). The probe's
    record in the workers (which a worker can append to or rewrite) otherwise only names the writes and adds those
    outside the watched folders: it can fail a job, never pass one.

    With ``crash_rank``/``crash_step`` (hidden test): judged on that restart run, every attempt's workers:
    each rank 0 writes the checkpoint once per epoch it finished."""
    check = "check_checkpoint_rank0"
    run = graded_run(script, check, crash_rank, crash_step, layout)
    context = restart_context(run)
    others = {w.rank: writes_of(w, run) for w in run.workers if w.rank != 0}
    others = {r: found for r, found in others.items() if found}
    if others:
        rank, found = sorted(others.items())[0]
        only_final = all("'final.pt'" in f for writes in others.values() for f in writes)
        raise CheckFailed(
            check,
            context + f"{rank_list(others)} wrote {'the final weights' if only_final else 'the checkpoint'} too "
            f"(rank {rank}: {', '.join(found[:3])})",
            ranks=list(others),
            expected="only rank 0 writes the checkpoint and final.pt: every rank holds the same weights, and "
            "several writers race on the same file (a reader can get a half-written one)",
            hint="guard every save with `if rank == 0:` (keep collectives such as barrier() outside the guard)",
        )
    writers_from_the_kernel(check, run, context)  # the verdict: who the kernel showed writing, from outside
    torchrun.require_ok(check, run)
    rank0 = [w for w in run.workers if w.rank == 0]
    if run.scenario == "restart" and any(w.of("step") for w in rank0):
        # each attempt's rank 0: one checkpoint per epoch it finished (the crashed one too, before the crash)
        owed = [(w, len(commits_of(w, run)), len(w.of("step")) // STEPS_PER_EPOCH) for w in rank0]
    else:
        owed = [(rank0[0] if rank0 else None, len(commits_of(rank0[0], run)) if rank0 else 0, EPOCHS)]
    for w, written, epochs in owed:
        attempt = f" (attempt {w.attempt})" if run.scenario == "restart" and w is not None else ""
        expect(
            written >= epochs and run.ckpt_exists,
            check,
            context + f"rank 0{attempt} wrote the checkpoint {written} time(s) in {epochs} epochs"
            + ("" if run.ckpt_exists else ", and there is no file at --ckpt at the end"),
            ranks=[0],
            expected=f"a checkpoint at the path given by --ckpt after every epoch (at least {epochs} writes)",
            hint="rank 0 writes the checkpoint to the --ckpt path at the end of every epoch",
        )
    if run.files is not None and not torchrun.lone_moves(run.files, *os.path.split(run.ckpt_path)):
        # the kernel's count, which no record in a worker can raise; not where the checkpoint was moved in from a
        # folder the launcher did not watch (which check_atomic_checkpoint fails): the kernel keeps two such moves
        # in a row as one when it is read late, so its count could be short of an honest rank 0's; the record
        # (above) is then what says how often
        written = len(kernel_commits(run, run.ckpt_path))
        expect(written >= EPOCHS, check, context + f"the checkpoint was put in place {written} time(s) in the job's "
               f"{EPOCHS} epochs (the kernel's count, read by the grader's launcher; rank 0's record claims more)",
               ranks=[0], expected=f"a checkpoint at the path given by --ckpt after every epoch (at least {EPOCHS} "
               "moves into place or writes over the whole job)", got=f"{written}",
               hint="rank 0 writes the checkpoint to the --ckpt path at the end of every epoch")
    passed(check)


def check_atomic_checkpoint(script: str = "train.py", *, crash_rank: int | None = None,
                            crash_step: int | None = None, layout: tuple[int, ...] | None = None) -> None:
    """The checkpoint is written to a temporary file in the same folder and moved into place with os.replace.

    Judged on what the kernel saw happen to the checkpoint's folder (the grader's inotify watch, outside the
    workers: nothing a worker writes about itself counts): the checkpoint's own name is never created, written,
    or deleted in place, only moved into place whole from a file of the same folder. With ``crash_rank``/
    ``crash_step`` (hidden test): judged on that restart run, every attempt."""
    check = "check_atomic_checkpoint"
    run = graded_run(script, check, crash_rank, crash_step, layout)
    name = os.path.basename(run.ckpt_path)
    hint = ("write to a temporary file next to it, then move it into place in one step: "
            "tmp = ckpt_path + '.tmp'; torch.save(state, tmp); os.replace(tmp, ckpt_path)")
    if run.files is None:  # no inotify on this grader (not Linux): what the probe saw in the workers
        atomic_from_the_probe(check, run, name, hint)
        passed(check)
        return
    folder = os.path.dirname(run.ckpt_path)
    seen = [e for e in run.files if e.folder == folder]
    mine = [e for e in seen if e.name == name]
    written = [e for e in mine if e.kind in ("create", "modify", "close_write")]
    expect(
        not written,
        check,
        restart_context(run) + f"the job wrote the checkpoint in place: {name!r} itself was "
        f"{'created and ' if any(e.kind == 'create' for e in written) else ''}written to (the grader watched its "
        "folder), so a crash or kill during that write leaves a truncated checkpoint, and the restart cannot load it",
        ranks=[0],
        hint=hint,
    )
    expect(
        not any(e.kind == "delete" for e in mine),
        check,
        restart_context(run) + f"{name!r} was deleted before the new checkpoint took its place: a crash between "
        "the two leaves no checkpoint at all",
        ranks=[0],
        hint="os.replace(tmp, ckpt_path) replaces the old file in one step: no need to remove it first",
    )
    moved_in = [e for e in mine if e.kind == "moved_to"]
    if not moved_in:
        if not run.ok:
            raise torchrun.failure(check, run, "no checkpoint was written: ")
        raise CheckFailed(check, f"rank 0 never moved a finished file into {name!r} with os.replace",
                          ranks=[0], hint=hint)
    here = {e.cookie for e in seen if e.kind == "moved_from"}
    far = [e for e in moved_in if e.cookie not in here]
    expect(
        not far,
        check,
        f"the temporary file is not in the checkpoint's folder (it was moved into {name!r} from another folder): "
        "os.replace is atomic only within one file system (across file systems it fails or copies)",
        ranks=[0],
        hint="put the temporary file next to the checkpoint: tmp = ckpt_path + '.tmp'",
    )
    passed(check)


def _final_weights(check: str, run: torchrun.Run) -> dict:
    if run.final is None:
        raise CheckFailed(check, "rank 0 did not write the final weights to OUT/final.pt", ranks=[0],
                          hint="at the end, on rank 0: torch.save(model.state_dict(), os.path.join(args.out, 'final.pt'))")
    if isinstance(run.final, str):
        raise CheckFailed(check, f"OUT/final.pt does not load as a state_dict: {run.final}", ranks=[0],
                          hint="save model.state_dict() (a dict of tensors), not the model object")
    wrapped = sorted(k for k in run.final if k.startswith("module."))
    if wrapped and len(wrapped) == len(run.final):
        raise CheckFailed(check, "OUT/final.pt holds the DDP wrapper's state dict: the given model without DDP cannot "
                          "load it", ranks=[0], expected=f"the model's own keys ({', '.join(k[7:] for k in wrapped[:3])})",
                          got=f"keys {', '.join(wrapped[:3])}: each with DDP's 'module.' prefix",
                          hint="save the model inside the wrapper: ddp_model.module.state_dict() (or the model you "
                          "wrapped: model.state_dict())")
    return run.final


def _require_all_reduced(check: str, run: torchrun.Run) -> None:
    """Every worker all-reduced at least one model's worth of gradient values per optimizer step.

    Seen in torch's flight recorder (what the process group really ran), so right weights computed
    without communication (every rank training on every rank's batches by itself) are not DDP."""
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        return  # a torch without the flight recorder: the weights alone decide
    n_params = sum(p.numel() for p in make_model().parameters())
    short = {}
    for w in run.workers:
        entries = w.collectives or []  # None: the worker never reported them (it took no step, or hid them)
        reduced = sum(e["numel"] for e in entries if e["op"] in ("all_reduce", "allreduce", "all_reduce_coalesced",
                                                                  "reduce_scatter", "_reduce_scatter_base"))
        # the steps before the worker's last record (a worker torchrun stopped may have stepped once more)
        records = [i for i, e in enumerate(w.events) if e["event"] == "collectives" and "entries" in e]
        # (a step at learning rate 0 trains nothing: torch.distributed.checkpoint's set_state_dict takes one to
        # make an empty optimizer's state, with zero gradients and no all-reduce)
        events = w.events[:records[-1]] if records else w.events
        steps = len([e for e in events if e["event"] == "step" and any(lr != 0 for lr in e.get("lr") or [1.0])])
        if reduced < steps * n_params:
            short[w.rank] = (reduced, steps)
    if short:
        rank, (reduced, steps) = sorted(short.items())[0]
        raise CheckFailed(
            check,
            f"{rank_list(short)} did not average gradients with the other ranks: rank {rank} all-reduced "
            f"{reduced} values in {steps} optimizer steps",
            ranks=list(short),
            expected=f"at least {n_params} all-reduced gradient values per step (the model's parameters), "
            "as DDP's backward does",
            hint="wrap the model in DDP (ddp_model = DDP(model)) and train through it (give it to train_epoch): every "
            "rank trains on its own batch and DDP averages the gradients; do not compute the other ranks' batches "
            "yourself",
        )


def _resumes(run: torchrun.Run) -> list[tuple[int, int, bool] | None]:
    """How the restart run's rank 0 resumed, as :func:`expected_weights` takes it (None: no restart).

    Seen in the restarted rank 0: whether it read the checkpoint (the state after the epochs before the crash's)
    and how many epochs it trained; with its momentum kept or lost (both are tried: that is
    check_restart_resume's to judge, not the gradient averaging's)."""
    restarted = [w for w in run.attempt(1) if w.rank == 0] if run.crash else []
    if not restarted:
        return [None]
    w = restarted[0]
    loaded = any(e.get("path") == run.ckpt_path for v in run.attempt(1) for e in v.of("load") + v.of("open"))
    restored = (run.crash[1] - 1) // STEPS_PER_EPOCH if loaded else 0  # read by rank 0, or sent to it by the reader
    first = max(EPOCHS - len(w.of("step")) // STEPS_PER_EPOCH, 0)
    return [None, (restored, first, True, run.crash_note), (restored, first, False, run.crash_note)]


def check_ddp_training(script: str = "train.py", *, crash_rank: int | None = None,
                       crash_step: int | None = None, layout: tuple[int, ...] | None = None) -> None:
    """The final weights of the uninterrupted 3-rank run equal one process training on all ranks' batches.

    With ``crash_rank``/``crash_step``/``layout`` (hidden test): judged on that restart run, against one
    process training on all its ranks' batches and resuming as the run's rank 0 did (how it resumed is
    check_restart_resume's part), and every worker of both attempts all-reduced its gradients."""
    check = "check_ddp_training"
    run = graded_run(script, check, crash_rank, crash_step, layout)
    if not run.ok:
        # ranks that never averaged their gradients run apart: on two nodes, one finishes alone while the other's
        # worker died, and the job can no longer end. That is the mistake to name, not the job's end.
        _require_all_reduced(check, run)
    torchrun.require_ok(check, run)
    final = _final_weights(check, run)
    restart = run.scenario == "restart"
    world_size = run.world_size
    resumes = _resumes(run) if restart else [None]
    reference = expected_weights(world_size, data=data_of(run))
    diff = compare_weights(final, reference)
    if diff is None:
        raise CheckFailed(check, "final.pt does not hold this model's weights",
                          expected=sorted(reference), got=sorted(final), ranks=[0],
                          hint="save the model's state_dict (model.state_dict(), or ddp_model.module.state_dict())")
    if diff > ATOL:
        diff = min(compare_weights(final, expected_weights(world_size, None, r, data_of(run, r))) for r in resumes)
    if diff > ATOL:
        alone = min(compare_weights(final, expected_weights(world_size, (0,), r, data_of(run, r))) for r in resumes)
        computed = any(run.forks) and min(compare_weights(final, expected_weights(world_size, None, r,
                                                                                 data_of(run, r, only=0)))
                                          for r in resumes) <= ATOL
        if computed:
            raise CheckFailed(
                check, restart_context(run) + "rank 0's final weights are those of one process training on every "
                "rank's batches, the other ranks' batches computed in rank 0's own worker (without the offset only "
                "each rank's own worker draws): their gradients never came from the other workers", ranks=[0],
                expected="every rank trains on its own batches, and DDP averages the gradients",
                got="the weights of one process training on all ranks' batches without their secret offsets",
                hint="wrap the model in DDP and give it to train_epoch with this worker's global rank: each rank "
                "computes only its own batch; do not compute the other ranks' batches yourself")
        hint = ("rank 0's weights are what rank 0 learns from its own batches alone: the gradients were never "
                "averaged. Wrap the model in DDP and train through ddp_model (the model you give train_epoch)"
                if alone is not None and alone <= ATOL else
                "train as the specification says: the given model in DDP, make_optimizer's optimizer, every epoch "
                "with train_epoch (get_batch(rank, epoch, step) for each step, with the global rank), "
                "and no change to the given functions")
        raise CheckFailed(
            check,
            restart_context(run) + "rank 0's final weights differ from "
            + (f"a {world_size}-rank DDP run that resumed as this one did" if restart else
               f"an uninterrupted {world_size}-rank DDP run") + f" (max |diff| {diff:.3g})",
            ranks=[0], expected=f"equal within {ATOL:g}", got=f"max |diff| = {diff:.3g}", hint=hint,
        )
    _require_all_reduced(check, run)  # right weights, but were they averaged, or computed alone?
    passed(check)


def _crash_context(crash: tuple[int, int]) -> str:
    rank, step = crash
    return (f"rank {rank} was killed after its optimizer step {step}, in epoch {(step - 1) // STEPS_PER_EPOCH} "
            f"(epochs 0-{EPOCHS - 1}); ")


def _valid_crash(crash_rank: int, crash_step: int, world_size: int = 2) -> tuple[int, int]:
    total = EPOCHS * STEPS_PER_EPOCH
    if not (0 <= crash_rank < world_size and 0 < crash_step < total - STEPS_PER_EPOCH and crash_step % STEPS_PER_EPOCH):
        # a crash at an epoch's last step races with that epoch's checkpoint: the right resume point is then unknown
        raise ValueError(f"the crash must hit one of the {world_size} ranks in the middle of an epoch before the "
                         f"last, not rank {crash_rank} at step {crash_step}")
    return crash_rank, crash_step
