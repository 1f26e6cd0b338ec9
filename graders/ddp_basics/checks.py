"""Checks for exercise 2, DDP basics (exercises/ex2-ddp-basics/ddp_basics.ipynb).

The student writes five small functions and a sampler class; each check runs one of them as real ranks and judges what
happened, never what the student's process says about itself:

* ``setup(rank, world_size)`` joins the job and returns a gloo group of every rank for collectives on CPU tensors
  (:func:`check_setup`: a collective through the real default group shows every rank in one group of the job's
  backend, as its own rank; one on CPU tensors through the returned group, that it is every rank's, in order);
* ``cleanup()`` leaves it (:func:`check_cleanup`: a new process group can be made afterwards,
  which torch allows only once the old one is really destroyed);
* ``ShardSampler``, a distributed sampler of the student's own, has its checks in :mod:`graders.ddp_basics.sampler`;
* ``train(rank, model, loader, epochs, lr)`` -> the DDP model, trained with SGD on the squared error SUMMED over each
  step's global batch (DDP averages the ranks' gradients: only a loop that accounts for that takes the summed
  objective's steps), calling ``loader.sampler.set_epoch(epoch)`` each epoch (:func:`check_training`,
  :func:`check_set_epoch`: what reached the model before each optimizer step, and the weights);
* ``save_checkpoint(rank, ddp_model, ckpt_path)`` writes ``{"model": ddp_model.module.state_dict(), "rng": every
  rank's CPU generator state}`` from rank 0 only, and no rank returns before the file is complete
  (:func:`check_checkpoint`: every file each rank wrote, rank 0's write held until the others wait for it, what
  every rank found when the function returned, and each rank's generator state, drawn from a seed only it knew).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common.ddp_model import (
    HOLD_LIMIT,
    _checkpoint_harness,
    _cleanup_harness,
    _reference,
    _setup_harness,
    _train_harness,
    file_digest,
    make_net,
)

ATOL = 1e-6
#: part 3's objective: the squared error summed over each step's global batch (all ranks' samples, every output)
REDUCTION = "sum"
_HARD_CODED = ("rank < size", "use the rank and world_size arguments; do not hard-code the number of ranks")


# --- setup and cleanup -------------------------------------------------------------------------
#
# The harnesses (graders.common.ddp_model) observe effects, never what the student's process says about itself.


def check_setup(setup, *, world_sizes=(2, 3)):
    """After setup(rank, world_size) every rank is in one process group of the job's backend, as
    rank ``rank`` of ``world_size`` (shown by a collective); under nccl each rank uses GPU LOCAL_RANK; and setup
    returned, on every rank, a gloo group of every rank in order (shown by a collective on CPU tensors through it)."""
    check = "check_setup"
    checks.require_written(check, setup=setup)
    hints = [_HARD_CODED, ("NCCL", "use the backend course.backend() picks (gloo on a CPU); do not hard-code nccl")]
    pinned = None
    alias, named = checks.backend_alias()  # the job's gloo named "cpu:gloo,cuda:ddpcourse": a fixed "gloo" shows
    for world_size in world_sizes:
        job = checks.run(check, _setup_harness, world_size, args=(setup,), hints=hints, env=alias)
        obs = job.values
        where = f"{world_size}-rank job"
        missing = [r for r, o in enumerate(obs) if not o["joined"]]
        if missing:
            raise CheckFailed(check, f"no process group after setup() ({where}): a collective could not run",
                              ranks=missing, got=obs[missing[0]]["error"],
                              hint="call dist.init_process_group(course.backend()) in setup")
        _judge_order(check, obs, f"the ranks did not join as ranks 0..{world_size - 1} of one group ({where})",
                     "pass rank=rank (or nothing: the environment has RANK)")
        backends = [o["backend"] for o in obs]
        wanted = named if named and job.backend == "gloo" else job.backend
        if set(backends) != {wanted}:
            fixed = [r for r, b in enumerate(backends) if b != wanted]
            raise CheckFailed(
                check, f"the process group uses another backend than the one course.backend() names for this job "
                f"({where})" + (f": {checks.rank_list(fixed)} joined with a fixed {backends[fixed[0]]!r}"
                                if wanted == named and checks.gloo_for_cpu(backends[fixed[0]]) else ""),
                ranks=fixed, expected=repr(wanted) + (" (the grader's CPU jobs name their backend so, gloo for CPU "
                                                      "tensors and a stand-in for CUDA ones, to tell course.backend() "
                                                      "from a fixed 'gloo')" if wanted == named else ""),
                got=backends, hint="dist.init_process_group(course.backend()): it says gloo on CPUs and nccl when "
                "every rank has a GPU; a fixed backend is right on one kind of machine only")
        if job.backend == "nccl":
            local = list(range(world_size))  # one machine: LOCAL_RANK == RANK
            devices = [o["device"] for o in obs]
            if devices != local:
                raise CheckFailed(check, f"the ranks did not each select their own GPU ({where})",
                                  ranks=[r for r in local if devices[r] != r], expected=f"cuda devices {local}",
                                  got=f"cuda devices {devices}",
                                  hint="torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) in setup")
            pinned = True
        elif pinned is None:
            pinned = False
        _judge_cpu_group(check, obs, backends[0], where)
    passed(check)
    if not pinned:
        print("  (not graded here: selecting each rank's GPU; this job ran on gloo, without a GPU per rank)")


def _judge_cpu_group(check, obs, default_backend, where) -> None:
    """The group setup() returned: a gloo group of every rank (whatever the default group's backend), in which rank r
    is rank r, shown by a collective on CPU tensors through it."""
    world_size = len(obs)
    groups = [o["cpu_group"] for o in obs]
    other = [r for r, g in enumerate(groups) if g["kind"] != "ProcessGroup"]
    if other:
        kinds = sorted({groups[r]["kind"] for r in other})
        raise CheckFailed(check, f"setup() returned {' / '.join(kinds)} on {checks.rank_list(other)}, not a process "
                          f"group ({where})", ranks=other,
                          expected="a process group of all the ranks for collectives on CPU tensors, returned on every "
                          "rank", got=", ".join(f"rank {r}: {groups[r]['kind']}" for r in other),
                          hint="every rank makes the same groups, in the same order, and setup() returns the one "
                          "for CPU tensors (lesson 2, section 3: more than one group)")
    unknown = [r for r, g in enumerate(groups) if "error" in g and "backend" not in g]
    if unknown:
        raise CheckFailed(check, f"torch does not know the group setup() returned ({where})", ranks=unknown,
                          got=groups[unknown[0]]["error"],
                          hint="make the group with torch.distributed's own function for new groups, after joining")
    inherited = [r for r, g in enumerate(groups) if g["backend"] == default_backend
                 and not (checks.gloo_for_cpu(g["backend"]) and g.get("made_for_gloo"))]
    if inherited:
        raise CheckFailed(check, f"the group setup() returned uses the job's default backend, "
                          f"{groups[inherited[0]]['backend']!r}, not gloo ({where})", ranks=inherited,
                          expected="gloo for CPU tensors whatever the default group's backend is (the grader's CPU "
                          "jobs name the default 'cpu:gloo,cuda:ddpcourse', so a group that takes the default's "
                          "shows here as on a GPU machine, where it would be nccl, which runs no collective on CPU "
                          "tensors)",
                          got=f"{groups[inherited[0]]['backend']!r}" + (
                              " (the default group itself)" if groups[inherited[0]].get("is_default") else ""),
                          hint="a new group takes the default group's backend unless it is given its own")
    wrong = [r for r, g in enumerate(groups) if not checks.gloo_for_cpu(g["backend"])]
    if wrong:
        raise CheckFailed(check, f"the group setup() returned uses backend {groups[wrong[0]]['backend']!r}, not gloo "
                          f"({where})", ranks=wrong, expected="'gloo': collectives on CPU tensors",
                          got=", ".join(f"rank {r}: {groups[r]['backend']!r}" for r in wrong),
                          hint="give the group for CPU tensors the backend that runs on CPUs")
    renamed = [r for r, g in enumerate(groups) if not g.get("made_for_gloo")]
    if renamed:
        raise CheckFailed(check, f"torch's registry calls the group setup() returned gloo, but the group itself was not "
                          f"made with a gloo backend of its own ({where})", ranks=renamed,
                          expected="a group made with gloo for CPU tensors (backend 'gloo' or 'cpu:gloo'): its own "
                          "backend, not the default's",
                          got=f"rank {renamed[0]}'s group runs the default's backends (for CUDA tensors, the "
                          "default's stand-in): it was made with the default's backend, and only its name says gloo",
                          hint="make the group with the backend it must have; renaming it in torch's tables changes "
                          "nothing it runs")
    small = [r for r, g in enumerate(groups) if g["size"] != world_size]
    if small:
        raise CheckFailed(check, f"the group setup() returned does not hold every rank ({where})", ranks=small,
                          expected=f"{world_size} ranks in it", got=", ".join(f"rank {r}: {groups[r]['size']}"
                                                                             for r in small),
                          hint="the group for CPU tensors is the whole job's, every rank in it")
    failed = [r for r, g in enumerate(groups) if "error" in g]
    if failed:
        raise CheckFailed(check, f"a collective on CPU tensors through the group setup() returned failed ({where})",
                          ranks=failed, got=groups[failed[0]]["error"],
                          hint="the group for CPU tensors must be a gloo group of every rank")
    _judge_order(check, groups, f"in the group setup() returned, the ranks are not ranks 0..{world_size - 1} in "
                 f"order ({where})", "list the ranks of the group in order (or let torch take them all)")


def _judge_order(check, seen: list[dict], problem: str, hint: str) -> None:
    """Each rank drew a token and all-gathered it (``seen[r]``: its ``token`` and the ``gathered`` list): every rank
    must hold every token at its owner's rank, else the group's ranks are not the processes' own."""
    tokens = [s["token"] for s in seen]
    misplaced = [r for r, s in enumerate(seen) if s["gathered"] != tokens]
    if misplaced:
        order = [s["gathered"].index(tokens[r]) if tokens[r] in s["gathered"] else "?" for r, s in enumerate(seen)]
        raise CheckFailed(check, problem, ranks=misplaced, expected=f"process r is rank r: {list(range(len(seen)))}",
                          got=f"group ranks {order}", hint=hint)


def check_cleanup(cleanup, *, world_sizes=(2, 3)):
    """After cleanup() the process group is destroyed on every rank: a new one can be made (and works)."""
    check = "check_cleanup"
    checks.require_written(check, cleanup=cleanup)
    for world_size in world_sizes:
        store_dir = tempfile.mkdtemp(prefix="ddp-course-cleanup-")
        try:
            job = checks.run(check, _cleanup_harness, world_size, args=(cleanup, store_dir))
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
        still_up = [r for r, o in enumerate(job.values) if not o["destroyed"]]
        if still_up:
            raise CheckFailed(check, f"the process group is still up after cleanup() ({world_size}-rank job)",
                              ranks=still_up, expected="the default process group destroyed on every rank",
                              got=f"{checks.rank_list(still_up)}: a new init_process_group failed with "
                              f"\"{job.values[still_up[0]]['error']}\"",
                              hint="in cleanup, destroy the process group (destroy_process_group) on every rank")
        broken = [r for r, o in enumerate(job.values) if not o["rejoined"]]
        if broken:
            raise CheckFailed(check, f"after cleanup() a new process group does not work ({world_size}-rank job)",
                              ranks=broken, got=job.values[broken[0]].get("error"),
                              hint="cleanup() should only destroy the process group (destroy_process_group)")
    passed(check)


# --- training ----------------------------------------------------------------------------------


def _run_train(check, train, world_size, n, batch_size, epochs, lr, seed):
    hints = [("Expected to have finished reduction", "every parameter must take part in the loss"),
             ("timeout", "every rank must run the same number of steps and call the same collectives; "
                         "no collective (all_reduce, barrier, ...) inside `if rank == 0:`")]
    return checks.run(check, _train_harness, world_size, args=(train, n, batch_size, epochs, lr, seed),
                      hints=hints).values


def _step_plan(n, world_size, batch_size, epochs) -> tuple[int, int]:
    """(samples per rank and epoch, optimizer steps per epoch) of the loop the exercise asks for."""
    per_rank_n = math.ceil(n / world_size)
    return per_rank_n, math.ceil(per_rank_n / batch_size)


def _judge_steps(check, obs, n, batch_size, epochs, where) -> None:
    """Every rank took epochs x steps-per-epoch optimizer steps, each on one batch of the loader."""
    world_size = len(obs)
    per_rank_n, per_epoch = _step_plan(n, world_size, batch_size, epochs)
    strangers = [r for r, o in enumerate(obs) if any(i < 0 for step in o["steps"] for i in step)]
    if strangers:
        raise CheckFailed(check, f"the model was given inputs that are not the loader's samples ({where})",
                          ranks=strangers, expected="each batch x exactly as the loader gives it (moved to the device)",
                          hint="for x, y in loader: x, y = x.to(device), y.to(device); output = ddp_model(x)")
    counts = [len(o["steps"]) for o in obs]
    if counts != [epochs * per_epoch] * world_size:
        raise CheckFailed(check, f"train() took the wrong number of optimizer steps ({where})",
                          ranks=[r for r, k in enumerate(counts) if k != epochs * per_epoch],
                          expected=f"{epochs} epochs x {per_epoch} batches = {epochs * per_epoch} steps per rank",
                          got=f"{counts}",
                          hint="one optimizer step per batch: every epoch goes through every batch of the loader"
                          if any(counts) else "no torch.optim optimizer stepped: the grader counts the steps of one "
                          "(torch.optim.SGD(model.parameters(), lr=...) and its step()); weights updated by hand are "
                          "not seen")
    for rank, o in enumerate(obs):
        for e in range(epochs):
            epoch_steps = o["steps"][e * per_epoch:(e + 1) * per_epoch]
            sizes = [len(step) for step in epoch_steps]
            expected = [batch_size] * (per_epoch - 1) + [per_rank_n - batch_size * (per_epoch - 1)]
            if sizes != expected:
                raise CheckFailed(check, f"the optimizer steps did not each use one batch of the loader ({where})",
                                  ranks=[rank], expected=f"samples per step in epoch {e}: {expected}", got=f"{sizes}",
                                  hint="one forward, backward and optimizer.step() per batch: zero_grad() first")


def _epochs(steps, per_epoch, epochs):
    """The samples each epoch's steps used, in order."""
    return [[i for step in steps[e * per_epoch:(e + 1) * per_epoch] for i in step] for e in range(epochs)]


def _diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def check_training(train, *, world_sizes=(2, 3), n=12, batch_size=2, epochs=2, lr=0.02, seed=0):
    """train() takes one optimizer step per batch of every epoch; after it, parameters are bitwise equal
    on every rank and equal (1e-6) to one process that took SGD steps with the same lr on the squared error summed
    over the global batches."""
    check = "check_training"
    checks.require_written(check, train=train)
    for world_size in world_sizes:
        obs = _run_train(check, train, world_size, n, batch_size, epochs, lr, seed)
        where = f"{world_size}-rank job, {epochs} epochs"
        _judge_steps(check, obs, n, batch_size, epochs, where)
        states = [o["state"] for o in obs]
        differ = [r for r in range(1, world_size) if any(not torch.equal(states[0][k], states[r][k]) for k in states[0])]
        if differ:
            raise CheckFailed(check, f"the ranks end with different parameters ({where})", ranks=differ,
                              expected="bitwise the same parameters on every rank",
                              got=f"max difference from rank 0: {max(_diff(states[r], states[0]) for r in differ):.3g}",
                              hint="wrap the model, ddp_model = DDP(model), and train ddp_model (forward, "
                              "backward and the optimizer over ddp_model.parameters()): DDP averages the "
                              "gradients and starts every rank from rank 0's weights")
        steps = [o["steps"] for o in obs]
        reference = _reference(steps, n, lr, seed, reduction=REDUCTION)
        if _diff(states[0], reference) > ATOL:
            raise CheckFailed(check, f"the trained parameters differ from one process trained on the summed "
                              f"squared error of the global batches ({where})", ranks=range(world_size),
                              expected="the same parameters within 1e-6, each step SGD's with lr on the squared "
                              "error summed over the step's global batch (all ranks' samples, every output)",
                              got=f"max difference {_diff(states[0], reference):.3g}",
                              hint=_training_hint(states[0], steps, n, lr, seed, world_size, batch_size))
        if not any(o["is_ddp"] for o in obs):
            raise CheckFailed(check, f"train() returned {obs[0]['returned']}, not the DDP model ({where})",
                              expected="ddp_model (a DistributedDataParallel)",
                              hint="return ddp_model at the end of train: save_checkpoint needs it")
    passed(check)


def _training_hint(state, steps, n, lr, seed, world_size, batch_size):
    """What the weights a wrong loop ended with match: one of the usual mistakes, recomputed, named."""
    guesses = [
        (dict(lr_scale=1 / world_size), f"each step was 1/{world_size} of the summed objective's: DDP averages "
         f"the {world_size} ranks' gradients, so a rank's summed loss counts 1/{world_size}. The objective is the "
         "sum over the whole global batch: make what DDP averages come out as that sum"),
        (dict(reduction="mean"), "the steps are those of the MEAN squared error over the global batch: the objective "
         "here is the SUM over the global batch (every output of every sample of every rank)"),
        (dict(lr_scale=world_size), f"the steps are {world_size} x too large: the ranks' gradients were added up "
         "twice (the summed objective once, then once more)"),
        (dict(zero_grad=False), "the gradients accumulate across steps: zero them once per step"),
        (dict(lr_scale=0.0), "the parameters never changed: take one optimizer step per batch, after backward"),
    ]
    for kwargs, hint in guesses:
        kwargs = {"reduction": REDUCTION, **kwargs}
        if _diff(state, _reference(steps, n, lr, seed, **kwargs)) <= ATOL:
            return hint
    return ("one SGD step with lr per batch, on the squared error summed over the global batch; think about what "
            "DDP does with the ranks' gradients in backward (lesson 2, section 6)")


def check_set_epoch(train, *, world_sizes=(2, 3), n=12, batch_size=2, epochs=3, lr=0.02, seed=0):
    """train() calls loader.sampler.set_epoch(epoch) each epoch: a new order every epoch, the same on all ranks."""
    check = "check_set_epoch"
    checks.require_written(check, train=train)
    for world_size in world_sizes:
        obs = _run_train(check, train, world_size, n, batch_size, epochs, lr, seed)
        where = f"{world_size}-rank job, {epochs} epochs, {n} samples"
        _judge_steps(check, obs, n, batch_size, epochs, where)
        steps_per_epoch = _step_plan(n, world_size, batch_size, epochs)[1]
        per_epoch = [_epochs(o["steps"], steps_per_epoch, epochs) for o in obs]
        for epoch in range(epochs):
            shards = [p[epoch] for p in per_epoch]
            seen = [i for s in shards for i in s]
            if len(set(seen)) != n:
                raise CheckFailed(check, f"in epoch {epoch} the ranks' shards overlap: they shuffled differently "
                                  f"({where})", ranks=range(world_size),
                                  expected=f"all {n} samples spread over the ranks",
                                  got=f"{n - len(set(seen))} sample(s) read by no rank",
                                  hint="call loader.sampler.set_epoch(epoch) on every rank, with the same "
                                  "epoch number (not the rank)")
        same = [e for e in range(1, epochs) if all(p[e] == p[e - 1] for p in per_epoch)]
        if same:
            raise CheckFailed(check, f"epoch {same[0]} read the samples in the same order as epoch {same[0] - 1} "
                              f"({where})", ranks=range(world_size), expected="a new order every epoch",
                              got=f"rank 0 read {per_epoch[0][same[0]]} in epochs {same[0] - 1} and {same[0]}",
                              hint="call loader.sampler.set_epoch(epoch) at the start of every epoch")
    passed(check)


# --- checkpoint --------------------------------------------------------------------------------


def check_checkpoint(save_checkpoint, *, world_sizes=(2, 3), seed=0):
    """Only rank 0 writes ckpt_path (every file each rank writes is seen, however it is written): a dict whose
    "model" is a plain state_dict (no `module.` prefix) that loads into a model without DDP (strict=True) and holds
    the trained parameters, and whose "rng" holds every rank's CPU generator state at the call, in rank order (each
    drawn from a seed only that rank knew); no rank returns before rank 0's file is complete: rank 0's write is
    held until every other rank waits for it in a collective (a barrier after the save) or has returned."""
    check = "check_checkpoint"
    checks.require_written(check, save_checkpoint=save_checkpoint)
    hints = [("Connection closed by peer", "a collective (barrier, all_reduce, ...) inside `if rank == 0:` waits "
                                          "for ranks that never call it: keep collectives outside the if"),
             ("timeout", "a collective (barrier, all_reduce, ...) inside `if rank == 0:` waits forever for the "
                         "other ranks: keep collectives outside the if, called by every rank")]
    for world_size in world_sizes:
        workdir = tempfile.mkdtemp(prefix="ddp-course-ckpt-")
        try:
            ckpt_path = os.path.join(workdir, "shared", "ckpt.pt")
            os.makedirs(os.path.dirname(ckpt_path))
            hold = min(HOLD_LIMIT, checks.check_timeout() / 6)
            job = checks.run(check, _checkpoint_harness, world_size,
                              args=(save_checkpoint, ckpt_path, workdir, seed, hold), hints=hints)
            _judge_checkpoint(check, job.values, ckpt_path, world_size)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    passed(check)


def _judge_checkpoint(check, obs, ckpt_path, world_size):
    where = f"{world_size}-rank job"
    name = os.path.basename(ckpt_path)
    folder = os.path.dirname(ckpt_path)  # a temporary file beside it, then os.replace, is fine
    written = {r: list(dict.fromkeys([e["path"] for e in o["writes"]] + o["files"])) for r, o in enumerate(obs)}
    others = {r: paths for r, paths in written.items() if r != 0 and paths}
    if others:
        rank, paths = sorted(others.items())[0]
        what = name if ckpt_path in paths else "a file"
        if any(os.path.dirname(p) == folder for p in written[0]):
            problem = f"{checks.rank_list(others)} also wrote {what} ({where})"
            hint = "save only when rank == 0: every rank holds the same weights, one copy is enough"
        else:
            problem = f"{checks.rank_list(others)} wrote {what} instead of rank 0 ({where})"
            hint = "save when rank == 0 (rank 0 exists in every job)"
        raise CheckFailed(check, problem, ranks=list(others), expected="only rank 0 writes the checkpoint (no other "
                          "rank writes any file, under any name)",
                          got=f"rank {rank} wrote {_listed(paths)}", hint=hint)
    # a file rank 0 wrote elsewhere and still there (a temporary file it moved onto ckpt_path is gone)
    elsewhere = [p for p in written[0] if os.path.dirname(p) != folder and os.path.exists(p)]
    if elsewhere:
        raise CheckFailed(check, f"a checkpoint was written somewhere other than ckpt_path ({where})", ranks=[0],
                          expected=f"torch.save(..., ckpt_path) (here {ckpt_path})",
                          got=f"rank 0 wrote {_listed(elsewhere)}", hint="save to the ckpt_path argument")
    if not written[0] and not os.path.exists(ckpt_path):
        raise CheckFailed(check, f"no rank wrote {name} ({where})", expected=f"rank 0 writes {name}",
                          hint="rank 0 saves the checkpoint to the ckpt_path it is given")
    try:
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is the student's mistake
        raise CheckFailed(check, f"{name} is not plain data ({where})", ranks=[0],
                          expected='{"model": a state_dict, "rng": a list of tensors}, readable with '
                          "torch.load(..., weights_only=True)",
                          got=f"{type(exc).__name__}: {_first_line(exc)}",
                          hint="save the model's state_dict (tensors), not the model object") from None
    if not isinstance(saved, dict) or "model" not in saved or "rng" not in saved:
        keys = sorted(map(str, saved))[:4] if isinstance(saved, dict) else None
        raise CheckFailed(check, f"{name} does not hold the two entries the part asks for ({where})", ranks=[0],
                          expected='a dict with "model" (the plain model\'s state_dict) and "rng" (every rank\'s '
                          "generator state)",
                          got=f"a dict with keys {keys}" if keys is not None else f"a {type(saved).__name__}",
                          hint="one dict holds both: the weights, and what every rank needs to resume its random "
                          "numbers")
    state = saved["model"]
    if not isinstance(state, dict):
        raise CheckFailed(check, f'{name}["model"] holds a {type(state).__name__}, not a state_dict ({where})',
                          ranks=[0], hint="save the plain model's state_dict (its tensors), not the model object")
    prefixed = [k for k in state if str(k).startswith("module.")]
    if prefixed:
        raise CheckFailed(check, f"the saved keys start with 'module.' ({where})", ranks=[0],
                          expected="keys of the plain model, e.g. '0.weight'", got=f"{prefixed[:3]}",
                          hint="you saved ddp_model.state_dict(): save ddp_model.module.state_dict(), "
                          "the model inside the DDP wrapper, so the file loads without DDP")
    plain = make_net(0)
    try:
        plain.load_state_dict(state, strict=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(check, f"{name} does not load into the model without DDP ({where})", ranks=[0],
                          expected="model.load_state_dict(torch.load(ckpt_path), strict=True) works",
                          got=_first_line(exc),
                          hint="save ddp_model.module.state_dict()") from None
    expected = obs[0]["state"]
    if any(not torch.equal(state[k], expected[k]) for k in expected):
        raise CheckFailed(check, f"{name} does not hold the model's current parameters ({where})", ranks=[0],
                          got=f"max difference {_diff(state, expected):.3g}",
                          hint="save the state_dict of the model you were given (ddp_model.module), as it is now")
    _judge_rng(check, saved["rng"], [o["rng"] for o in obs], name, where)
    final = file_digest(ckpt_path)
    early = [r for r, o in enumerate(obs) if r != 0 and o["seen"] != final]
    barrier = ("after rank 0's torch.save, call dist.barrier() on every rank (outside the if): a rank that goes on "
               "at once may read a checkpoint that is not written yet")
    if early:
        found = "no file" if obs[early[0]]["seen"] == "missing" else "an incomplete file"
        raise CheckFailed(check, f"save_checkpoint returned on {checks.rank_list(early)} before rank 0's {name} was "
                          f"complete ({where}; the grader wrote rank 0's file only once the others waited for it or "
                          "had returned)", ranks=early,
                          expected=f"every rank finds the whole {name} once save_checkpoint returns",
                          got=f"rank {early[0]} found {found}", hint=barrier)
    checks.did_not_wait(check, obs[0]["hold"] or {}, f"{name} ({where})", returned="returned",
                        expected="every other rank waits (dist.barrier()) until rank 0's file is complete",
                        hint=barrier + "; a sleep is not a barrier: no fixed time is long enough on every disk")


def _judge_rng(check, saved, states, name, where) -> None:
    """``saved`` (the file's "rng") holds, in rank order, the CPU generator state each rank had when save_checkpoint
    was called (``states``: drawn in each rank from a seed no other rank knew)."""
    world_size = len(states)
    if isinstance(saved, torch.Tensor) and saved.dim() == 2:  # the states stacked: row r is rank r's
        saved = list(saved)
    elif isinstance(saved, dict) and set(saved) == set(range(world_size)):  # keyed by rank
        saved = [saved[r] for r in range(world_size)]
    if not isinstance(saved, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in saved):
        raise CheckFailed(check, f'{name}["rng"] is not a list of generator states ({where})', ranks=[0],
                          expected=f"a list of {world_size} tensors: rank r's torch.get_rng_state() at index r",
                          got=type(saved).__name__, hint="gather every rank's state to rank 0 before it saves")
    if len(saved) != world_size:
        raise CheckFailed(check, f'{name}["rng"] holds {len(saved)} state(s) in a {world_size}-rank job ({where})',
                          ranks=[0], expected=f"{world_size}: one per rank, in rank order",
                          hint="every rank's generator state, not only rank 0's")

    def owner(t):
        return next((r for r, want in enumerate(states) if t.shape == want.shape and torch.equal(t, want)), None)

    owners = [owner(t) for t in saved]
    if owners == list(range(world_size)):
        return
    bad = [i for i, o in enumerate(owners) if o != i]
    if owners.count(0) > 1 and all(o in (0, None) for o in owners):
        problem, hint = ('every entry of "rng" is rank 0\'s generator state: the other ranks\' states never reached '
                         "the file"), "each rank's state lives in that rank only: collect them on rank 0 before it saves"
    elif all(o is not None for o in owners):
        problem, hint = (f'"rng" holds every rank\'s state, in the order of ranks {owners}'), (
            "put rank r's state at index r")
    else:
        problem, hint = (f"entries {bad} of \"rng\" are no rank's generator state as it was when save_checkpoint "
                         "was called"), ("take each rank's state first thing in save_checkpoint, before anything "
                                         "draws a random number, and send it as it is")
    raise CheckFailed(check, f"{name}: {problem} ({where})", ranks=bad,
                      expected="index r: rank r's torch.get_rng_state() at the call (the grader drew each rank's "
                      "from a seed only that rank knew)", got=f"entries matching ranks {owners} (None: no rank's)",
                      hint=hint)


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _first_line(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return (text.splitlines() or [""])[0][:300]
