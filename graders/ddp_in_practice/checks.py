"""Checks for exercise 2's second notebook, DDP in practice (exercises/ex2-ddp-basics/ddp_in_practice.ipynb).

Pitfalls of lesson 2 that a training script meets once it works; the student writes one function
for each, and each check runs it on real ranks and judges what happened, never what the student's
process says about itself:

* ``hardest(model, dataset, rank, world_size, sample_losses, k)``: part 1, judged in
  :mod:`graders.ddp_in_practice.hardest`;
* ``accumulate_grads(ddp_model, micro_batches)``: the forward and backward passes of micro-batches of unequal
  sizes, their number changing from call to call, after which the given code takes one optimizer step
  (:func:`check_accumulation`: the weights equal one process's step on the mean loss over all ranks' samples
  together, each micro-batch through the model on its own: the model's BatchNorm makes one big batch in their
  place give another step, an effect no hook or record of the student's process decides; :func:`check_no_sync`: torch's flight recorder counts the all-reduces of the gradients
  the rank issued, one per step; a communication hook the grader registers on the DDP model sees in
  which backward; what that all-reduce carried (a spy on the collectives, :mod:`graders.common.comm_spy`)
  is the sum of all k micro-batches' gradients, and no other collective carried gradients);
* ``train_uneven(ddp_model, optimizer, batches, train_steps)``: train (with the given loop ``train_steps``) when
  ranks hold different numbers of batches (:func:`check_uneven`: the job finishes, every rank holds the same
  weights, and each step was averaged over the ranks that trained in it: Join over the active ranks, or a loop
  equalised to the fewest batches; then again with a few more batches on each rank, a number each rank draws
  and tells no one, so that counts read in the check's arguments are no rank's);
* ``load_checkpoint(ckpt_path, ddp_model, device)`` -> the saved epoch (:func:`check_load_checkpoint`:
  a checkpoint the grader writes as if saved from ``cuda:0``; torch's own restore step reports where
  each tensor went, and the model must hold the saved weights on its device, on every rank).

Part 5 (float16 autocast with a GradScaler, and gradient clipping) is judged in :mod:`graders.ddp_in_practice.precision`.

The harnesses take torch.distributed's functions before the student's code runs, and build the
observers (the model's forward, the communication hook, the optimizer's step hook, the restore
spy) themselves; what they record is judged here, in the grader's process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common import comm_spy
from graders.common.ddp_model import make_net
from graders.ddp_in_practice.harness import (
    SAVED_FROM,
    UNEVEN_EXTRA,
    _accumulate_harness,
    _accumulate_reference,
    _accumulated,
    _checkpoint_case,
    _load_harness,
    _uneven_harness,
    _uneven_reference,
    loss_weights,
    micro_count,
    save_from_gpu,
)

ATOL = 1e-6
#: seconds: a rank that waits for a partner that ran out of batches fails by then (the stall watch names most such
#: hangs within seconds; a right job on a loaded 2-core grader must never meet this deadline)
UNEVEN_TIMEOUT = 30.0


def _diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _same(states: list[dict]) -> list[int]:
    """The ranks whose parameters are not bitwise rank 0's."""
    return [r for r in range(1, len(states)) if any(not torch.equal(states[0][k], states[r][k]) for k in states[0])]


def _require_same_weights(check: str, states: list[dict], where: str, hint: str) -> None:
    """Fail ``check`` unless every rank ended with bitwise the same weights as rank 0."""
    differ = _same(states)
    if differ:
        raise CheckFailed(check, f"the ranks end with different weights ({where})", ranks=differ,
                          expected="bitwise the same weights on every rank",
                          got=f"max difference from rank 0: {max(_diff(states[r], states[0]) for r in differ):.3g}",
                          hint=hint)


# --- part 2: gradient accumulation with no_sync() -----------------------------------------------


def _run_accumulate(check, accumulate_grads, world_size, k, size, steps, lr, seed):
    hints = [("can only be called once", "the grader has registered the DDP model's communication hook: do not "
                                         "register one yourself"),
             ("timeout", "every rank must run the same backward passes with the same no_sync() pattern: a rank "
                         "that syncs when the others do not waits for them forever")]
    return checks.run(check, _accumulate_harness, world_size, args=(accumulate_grads, k, size, steps, lr, seed),
                      expected="accumulate_grads returns on every rank, the gradients accumulated in .grad",
                      hints=hints).values


def check_accumulation(accumulate_grads, *, world_size=2, k=4, size=3, steps=2, lr=0.1, seed=0):
    """Each call of accumulate_grads is followed by the given optimizer step; afterwards the ranks hold bitwise the
    same weights, equal (1e-6) to one process stepping on the mean loss over all the samples of all ranks'
    micro-batches, each micro-batch through the model on its own. The micro-batches have unequal sizes and their
    number changes from call to call (k, k + 1, ...): only a loss weighted by each micro-batch's share of the
    samples gives that step; and the model holds a BatchNorm layer, so one big batch in their place gives
    another (its statistics are the big batch's)."""
    check = "check_accumulation"
    checks.require_written(check, accumulate_grads=accumulate_grads)
    obs = _run_accumulate(check, accumulate_grads, world_size, k, size, steps, lr, seed)
    counts = [micro_count(k, step) for step in range(steps)]
    where = f"{world_size} ranks, {' then '.join(map(str, counts))} micro-batches of unequal sizes, {steps} calls"
    states = [o["state"] for o in obs]
    _require_same_weights(check, states, where,
                          "the last micro-batch's forward and backward must run outside no_sync(): only then "
                          "does DDP all-reduce the accumulated gradients (no_sync() skips it)")
    reference = _accumulate_reference(world_size, k, size, steps, lr, seed)
    if _diff(states[0], reference) > ATOL:
        guesses = [(dict(whole=True), "the micro-batches went through the model together, as one batch: the model's "
                                      "BatchNorm then normalised them with the whole batch's statistics. Run each "
                                      "micro-batch's forward and backward on its own (the whole batch at once is what "
                                      "accumulation is there to avoid), the first ones inside no_sync()"),
                   (dict(mode="count"), "each micro-batch counted as much as the others: dividing each loss by the "
                                        "number of micro-batches is right only when they are equally large; here a "
                                        "sample of a small micro-batch weighs more than one of a large one. Weight "
                                        "each micro-batch's mean loss by its share of this rank's samples"),
                   (dict(mode="none"), "the accumulated gradient is the sum of the micro-batches' mean gradients, "
                                       "several times the mean over the samples: weight each micro-batch's mean "
                                       "loss by its share of this rank's samples"),
                   (dict(last_only=True), "only the last micro-batch's gradient reached the step: the gradients "
                                          "were zeroed between the micro-batches. Let them add up in .grad: no "
                                          "zero_grad() inside accumulate_grads (the given step zeroes them after)")]
        hint = next((h for kw, h in guesses if _diff(states[0],
                     _accumulate_reference(world_size, k, size, steps, lr, seed, **kw)) <= ATOL),
                    "the step must be the one a single process takes on the mean loss over all the samples of the "
                    "call (every micro-batch of every rank): weight each micro-batch's loss by its size and let the "
                    "gradients add up in .grad for the given step")
        raise CheckFailed(check, f"the weights differ from one process's step on all the samples ({where})",
                          ranks=range(world_size), expected="the same weights within 1e-6",
                          got=f"max difference {_diff(states[0], reference):.3g}", hint=hint)
    passed(check)


def check_no_sync(accumulate_grads, *, world_size=2, k=4, size=3, steps=2, lr=0.1, seed=0):
    """Each call of accumulate_grads all-reduces the gradients once, in the backward of the last micro-batch
    (the others run inside no_sync()): torch's flight recorder counts the all-reduces of DDP's gradient
    bucket the call issued, the grader's communication hook says in which backward, what that all-reduce
    carried must be the accumulation of all the call's micro-batches' gradients (however each loss was
    weighted: check_accumulation judges that), and no other collective may carry them."""
    check = "check_no_sync"
    checks.require_written(check, accumulate_grads=accumulate_grads)
    obs = _run_accumulate(check, accumulate_grads, world_size, k, size, steps, lr, seed)
    where = f"{world_size} ranks, {k} then {k + 1} micro-batches per step"
    reference = _accumulate_reference(world_size, k, size, steps, lr, seed)
    right = all(_diff(o["state"], reference) <= ATOL for o in obs)
    weights = ("the weights are right (check_accumulation judges them); only the communication is wasted"
               if right else "check_accumulation's message says what is wrong with the weights")
    for rank, o in enumerate(obs):
        for call, c in enumerate(o["calls"]):
            synced, forwards, m = c["synced_at"], c["forwards"], micro_count(k, call)
            # how many all-reduces of the gradients: what the process group issued, where the flight
            # recorder says (the hook's record, in the student's reach, only says in which backward)
            count = len(synced) if c["all_reduces"] is None else c["all_reduces"]
            if count == 1 and synced == [forwards] and forwards >= 1:
                _judge_carried(check, rank, call, c, _accumulated(c, seed, rank, call, k, size), where,
                               world_size, weights)
                continue
            got = (f"call {call + 1}: {count} all-reduce(s) of the gradients; DDP's hook saw them in the backward "
                   f"passes after forwards {synced} of {forwards}" if count else f"call {call + 1}: no gradient all-reduce in "
                   f"{forwards} forwards and their backward passes")
            if count > 1:
                problem = f"DDP all-reduced the gradients {count} times in one accumulate_grads ({where})"
                hint = (f"run every micro-batch but the last ({m - 1} of {m} here; forward and backward) inside the "
                        f"DDP model's no_sync() context, and only the last outside it; {weights}")
            elif count == 0 or not synced:
                problem = f"DDP never all-reduced the gradients in one accumulate_grads ({where})"
                hint = ("the last micro-batch's forward and backward must run outside no_sync(): DDP decides in "
                        "the forward whether the next backward syncs; syncing by hand skips DDP's bucketed all-reduce")
            else:
                problem = f"DDP all-reduced the gradients before the last micro-batch ({where})"
                hint = _EARLY_SYNC
            raise CheckFailed(check, problem, ranks=[rank],
                              expected=f"1 all-reduce per call, in the backward of micro-batch {m} of {m}",
                              got=got, hint=hint)
    passed(check)


_EARLY_SYNC = ("sync in the last micro-batch, not an earlier one: the gradients added after the all-reduce stay on "
               "their rank; use no_sync() for every micro-batch but the last")


_MODES = ("share", "count", "none")  # how a micro-batch's loss may have been weighted (loss_weights)


def _judge_carried(check, rank, call, c, accumulated, where, world_size, weights):
    """The call's one gradient all-reduce carried what `.grad` held after all the call's backward passes (each
    micro-batch's loss weighted by its share of the samples, by 1 / their number, or not at all; times any
    overall factor, averaged before the all-reduce or not), and no other collective carried the gradients."""
    held, grads, sizes = accumulated
    k = len(grads)

    def after(j, mode):  # what .grad holds after micro-batch j + 1, as one flat tensor
        w = loss_weights(sizes, mode)
        return torch.cat([(held[n] + sum(w[i] * grads[i][n] for i in range(j + 1))).reshape(-1) for n in held])

    def carries(values, j):
        for m in _MODES:
            target = after(j, m)
            a, b = values.float().sort().values, target.float().sort().values  # a positive scale keeps the order
            fitted = float(a @ b / (b @ b).clamp_min(1e-30))  # the loss's overall scale (a summed loss, ...)
            if comm_spy.holds(values, target, (1.0, 1 / world_size, fitted), exactly=True):
                return True
        return False

    numel = sum(t.numel() for t in held.values())
    bucket = [r for r in c["carried"] if r["op"] == "all_reduce" and sum(v.numel() for v in r["values"]) == numel]
    if len(bucket) != 1:
        raise CheckFailed(check, f"the grader could not see what DDP's all-reduce carried in call {call + 1} ({where})",
                          ranks=[rank], expected="DDP's all-reduce issued from the backward of the last micro-batch, "
                          "on the thread that calls accumulate_grads",
                          got=f"the process group ran it, but {len(bucket)} were seen where the grader looks",
                          hint="call backward() on the thread that runs accumulate_grads, and leave torch's "
                          "dispatch as it is")
    values = torch.cat(bucket[0]["values"])
    if not carries(values, k - 1):
        early = [j + 1 for j in range(k - 1) if carries(values, j)]
        raise CheckFailed(check, f"DDP's all-reduce did not carry the gradients of all {k} micro-batches ({where})",
                          ranks=[rank], expected=f"in call {call + 1}, one all-reduce of the sum of the {k} "
                          "micro-batches' gradients (this rank's), in the backward of the last one",
                          got=(f"it carried the gradients of micro-batches 1 to {early[0]} only" if early else
                               "it carried other values than this rank's accumulated gradients"),
                          hint=_EARLY_SYNC if early else "accumulate the micro-batches' gradients in .grad (no "
                          "zero_grad() between them, no change to .grad by hand) and let the last backward sync")
    mine = [(held[n] + sum(w[i] * grads[i][n] for i in range(j + 1))).reshape(-1) for j in range(k) for n in held
            for w in (loss_weights(sizes, m) for m in _MODES) if held[n].numel() >= 8]
    others = Counter(r["op"] for r in c["carried"] if r is not bucket[0] and r["op"] in comm_spy.SENDS and any(
        comm_spy.holds(v, g, (1.0, 1 / world_size), exactly=False) for v in r["values"] for g in mine))
    if others:
        raise CheckFailed(check, f"the gradients were also sent by other collectives than DDP's one all-reduce "
                          f"({where})", ranks=[rank], expected=f"in call {call + 1}, the gradients communicated once, "
                          "by DDP's all-reduce in the last micro-batch's backward",
                          got="besides it, " + ", ".join(f"{n} x {op}" for op, n in others.items()) + " carrying "
                          "gradient values", hint=f"let DDP communicate: no all_reduce or all_gather of the gradients "
                          f"by hand, no_sync() for the first {k - 1} micro-batches and the last outside it; {weights}")


# --- part 3: uneven inputs ------------------------------------------------------------------------


ACCEPTED = {"join-active": "each step averaged over the ranks that trained in it (all batches used)",
            "fewest": "every rank training on the fewest batches (the extra ones left out)"}


def check_uneven(train_uneven, *, counts=(5, 3), size=2, lr=0.1, seed=0):
    """With counts[r] batches on rank r, train_uneven finishes (within 15 s), every rank ends with bitwise
    the same weights, and each step's gradient is the mean over the ranks that trained in it: the weights of
    every batch used, each step averaged over the ranks that still had one (Join with
    divide_by_initial_world_size=False, or by hand), or of every rank training on its first min(counts)
    batches, within 1e-6. Join's default (a finished rank's zeros counted in the mean) is named and fails. Then
    again with 1 to UNEVEN_EXTRA more batches on each rank, a number each rank draws itself and no other rank is told:
    the same, for the numbers the ranks really held (no rank knows the others' counts in advance)."""
    check = "check_uneven"
    checks.require_written(check, train_uneven=train_uneven)
    counts = [int(c) for c in counts]
    world_size = len(counts)
    fewest = min(counts)
    first = [r for r, c in enumerate(counts) if c == fewest]
    others = ", ".join(f"rank {r} has {c}" for r, c in enumerate(counts) if c != fewest)
    where = f"{world_size} ranks with {counts} batches"
    advice = ("ranks with different numbers of batches: the rank that runs out stops calling backward, so the "
              "others wait forever in DDP's gradient all-reduce. Wrap the loop in `with ddp_model.join():` "
              "(or `with Join([ddp_model]):`), which lets finished ranks shadow the others' all-reduces, or "
              "agree on the number of steps first (all_reduce the count with op=dist.ReduceOp.MIN) and all "
              "train that many")
    timeout = min(UNEVEN_TIMEOUT, checks.check_timeout())
    # the launcher names a hung (or deadlocked) job's ranks and where they wait; this check adds why:
    # checks.run gives a failure the "timeout" advice when the job hung, so the advice marks a hang
    hints = [("timeout", advice), ("Connection closed by peer", advice)]
    try:
        obs = checks.run(check, _uneven_harness, world_size, args=(train_uneven, counts, size, lr, seed),
                         hints=hints, timeout=timeout).values
    except CheckFailed as err:
        hung = err.hint == advice
        problem = (f"train_uneven did not return on every rank: {checks.rank_list(first)} ran out of batches "
                   f"first, after {fewest} batches ({others}) ({where})" if hung else err.problem)
        raise CheckFailed(check, problem, ranks=err.ranks, expected="train_uneven returns on every rank",
                          got=err.problem if hung else None, hint=err.hint, detail=err.detail) from None
    states = [o["state"] for o in obs]
    _require_same_weights(check, states, where,
                          "train the DDP model on every rank, through ddp_model (not ddp_model.module); with "
                          "Join, put the whole loop inside the `with`")
    initial = make_net(seed).state_dict()
    if _diff(states[0], initial) == 0:
        raise CheckFailed(check, f"the weights did not change ({where})", ranks=range(world_size),
                          expected=f"trained weights: at least {fewest} SGD steps on every rank",
                          got=f"optimizer steps per rank: {[o['steps'] for o in obs]}",
                          hint="train with the given loop (train_steps, given the DDP model, the optimizer and the "
                          "batches): it takes one SGD step per batch it is given")
    found = {mode: _diff(states[0], _uneven_reference(counts, size, lr, seed, mode)) for mode in ACCEPTED}
    if min(found.values()) > ATOL:
        recycled = _diff(states[0], _uneven_reference(counts, size, lr, seed, "recycled")) <= ATOL
        shrunk = _diff(states[0], _uneven_reference(counts, size, lr, seed, "join")) <= ATOL
        hint = ("in the steps after a rank ran out, the gradient was divided by the full world size: the finished "
                "ranks' zeros counted in the mean, so those steps were smaller by (ranks still training) / "
                "world_size. Average over the ranks that trained in the step (Join can: see its "
                "divide_by_initial_world_size), or train every rank on the fewest batches" if shrunk else
                "the ranks that ran out trained on their first batches again: a sample counts once per epoch; "
                "average each step over the ranks that still have a batch, or train every rank on min(counts) "
                "batches" if recycled else
                "train with the given train_steps over all of your batches, each step averaged over the ranks that "
                "still have one, or over the first min(counts) batches on every rank")
        problem = ("the steps after a rank ran out were averaged over the full world size (Join's default), not "
                   "over the ranks that trained in them" if shrunk else "the trained weights are neither those of "
                   "steps averaged over the ranks that trained in them nor of a loop equalised to the fewest batches")
        raise CheckFailed(check, f"{problem} ({where})", ranks=range(world_size),
                          expected=f"one of: {', '.join(ACCEPTED.values())} (within 1e-6)",
                          got=f"max difference {min(found.values()):.3g} from the nearest "
                          f"({ACCEPTED[min(found, key=found.get)]}); optimizer steps per rank: "
                          f"{[o['steps'] for o in obs]}", hint=hint)
    _private_counts_run(check, train_uneven, counts, size, lr, seed, hints, advice, timeout)
    passed(check)


def _private_counts_run(check, train_uneven, counts, size, lr, seed, hints, advice, timeout):
    """Run train_uneven again, each rank holding 1 to UNEVEN_EXTRA batches more than counts[rank], a number it drew
    itself (:func:`graders.ddp_in_practice.harness._uneven_harness`): the weights must again be those of steps averaged
    over the ranks that trained in them, or of every rank training on the fewest batches, for the numbers the ranks
    really held (as their harnesses drew them). A loop cut to min(counts) read from the check's arguments (in the
    caller's frame) trains fewer steps than the fewest any rank now holds."""
    world_size = len(counts)
    told = f"{world_size} ranks with {UNEVEN_EXTRA} batches or fewer more than {counts}, each rank's own number"
    try:
        obs = checks.run(check, _uneven_harness, world_size, args=(train_uneven, counts, size, lr, seed, True),
                         hints=hints, timeout=timeout).values
    except CheckFailed as err:
        hung = err.hint == advice
        problem = (f"train_uneven did not return on every rank when each rank held a number of batches the others "
                   f"were not told ({told})" if hung else err.problem)
        raise CheckFailed(check, problem, ranks=err.ranks, expected="train_uneven returns on every rank, whatever "
                          "each rank holds", got=err.problem if hung else None, hint=err.hint,
                          detail=err.detail) from None
    actual = [o.get("count") for o in obs]
    if not all(isinstance(c, int) and counts[r] < c <= counts[r] + UNEVEN_EXTRA for r, c in enumerate(actual)):
        raise CheckFailed(check, "the grader's record of the batches it gave the ranks was changed", ranks=range(
            world_size), expected="the harness's record of each rank's number of batches",
            hint="leave the grader's objects alone: use only the batches your function is given")
    where = f"{world_size} ranks with {actual} batches, each rank told only its own"
    states = [o["state"] for o in obs]
    _require_same_weights(check, states, where, "agree between the ranks at run time: every rank must take the same "
                          "steps (Join, or the number of steps all-reduced with op=dist.ReduceOp.MIN)")
    found = {mode: _diff(states[0], _uneven_reference(actual, size, lr, seed, mode)) for mode in ACCEPTED}
    if min(found.values()) > ATOL:
        cut = _diff(states[0], _uneven_reference(list(counts), size, lr, seed, "fewest")) <= ATOL
        raise CheckFailed(check, f"with numbers of batches no rank was told in advance, the weights are neither those "
                          f"of steps averaged over the ranks that trained in them nor of a loop equalised to the fewest "
                          f"batches ({where})", ranks=range(world_size),
                          expected=f"one of: {', '.join(ACCEPTED.values())} (within 1e-6), for the batches the ranks "
                          "held", got=(f"the weights of every rank training on min({list(counts)}) = {min(counts)} "
                                       "batches: the first run's numbers, not this run's" if cut else
                                       f"max difference {min(found.values()):.3g} from the nearest; optimizer steps "
                                       f"per rank: {[o['steps'] for o in obs]}"),
                          hint="no rank knows the others' numbers of batches in advance (the grader's arguments and "
                          "the first run's are not this run's): agree at run time, all_reduce the count with "
                          "op=dist.ReduceOp.MIN and all train that many, or use Join")


# --- part 4: every rank loads a checkpoint saved on rank 0's GPU ---------------------------------




def _restored_right(location: str, device: str) -> bool:
    if location == "cpu":
        return True
    try:
        where = torch.device(location)
    except (RuntimeError, ValueError):
        return False
    want = torch.device(device)
    return where.type == want.type and (where.index is None or where.index == want.index)


def check_load_checkpoint(load_checkpoint, *, world_size=2, seed=0):
    """Every rank's load_checkpoint(ckpt_path, ddp_model, device) of a checkpoint saved from cuda:0
    puts its tensors on the rank's own device (or the CPU), never on cuda:0 by default; leaves
    the model holding the saved weights, on ``device``; and returns the saved epoch."""
    check = "check_load_checkpoint"
    checks.require_written(check, load_checkpoint=load_checkpoint)
    saved, epoch = _checkpoint_case(seed)
    where = f"{world_size}-rank job"
    hints = [("Missing key(s) in state_dict: \"module.", "the checkpoint holds the plain model's weights (keys '0.weight', "
              "...); load them into the model inside the wrapper: ddp_model.module.load_state_dict(...)"),
             ("Unexpected key(s) in state_dict: \"epoch\"", "the checkpoint is a dict {'epoch': ..., 'model': "
              "state_dict}: load checkpoint['model'], return checkpoint['epoch']")]
    workdir = tempfile.mkdtemp(prefix="ddp-course-load-")
    try:
        ckpt_path = os.path.join(workdir, "ckpt.pt")
        save_from_gpu({"epoch": epoch, "model": saved}, ckpt_path)
        obs = checks.run(check, _load_harness, world_size, args=(load_checkpoint, ckpt_path, seed),
                         expected="load_checkpoint loads checkpoint['model'] into ddp_model.module and returns the epoch",
                         hints=hints).values
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    blind = [r for r, o in enumerate(obs) if not o["watched"]]
    if blind:
        raise CheckFailed(check, f"load_checkpoint changed torch's restore step: the grader's record of where "
                          f"torch.load put each tensor is no longer the first one torch consults ({where})",
                          ranks=blind, expected="torch.serialization's deserializers as they were (the grader's first)",
                          got="torch.serialization._package_registry edited during load_checkpoint",
                          hint="load with torch.load(ckpt_path, map_location=device) and leave torch's serialization "
                          "alone: map_location is what decides where the tensors go")
    misplaced = [r for r, o in enumerate(obs) if o["error"] or not all(_restored_right(x, o["device"])
                                                                      for x in o["restored"])]
    if misplaced:
        o = obs[misplaced[0]]
        got = (f"rank {misplaced[0]}: torch.load failed: {o['error']}" if o["error"] else
               f"rank {misplaced[0]} restored them on {', '.join(o['restored'])}")
        failed = [r for r in misplaced if obs[r]["error"] and SAVED_FROM not in obs[r]["restored"]]
        raise CheckFailed(check, (f"torch.load failed on {checks.rank_list(failed)} ({where})" if failed else
                                  f"torch.load put the checkpoint's tensors on {SAVED_FROM}, where rank 0 saved them, "
                                  f"not on each rank's device ({where})"), ranks=misplaced,
                          expected=f"on each rank's device (rank {misplaced[0]}: {o['device']}) or on the CPU",
                          got=got, hint="torch.load(ckpt_path, map_location=device), with the device the function is "
                          "given (right on a GPU's machine and a CPU's alike): without map_location every rank loads "
                          "onto the GPU the file was saved from (here one this rank does not have; on a GPU machine, "
                          "all ranks would fill GPU 0), and a fixed 'cuda' fails where there is no GPU")
    elsewhere = [r for r, o in enumerate(obs) if o["on"] != [o["device"]]]
    if elsewhere:
        o = obs[elsewhere[0]]
        raise CheckFailed(check, f"after load_checkpoint the model is not on the rank's device ({where})",
                          ranks=elsewhere, expected=f"every parameter on {o['device']}", got=f"on {o['on']}",
                          hint="load_state_dict copies into the model's own tensors where they are: do not move "
                          "the model or pass assign=True")
    stale = [r for r, o in enumerate(obs) if any(not torch.equal(o["state"][k], saved[k]) for k in saved)]
    if stale:
        raise CheckFailed(check, f"the model does not hold the saved weights after load_checkpoint ({where})",
                          ranks=stale, expected="the weights of checkpoint['model'], exactly",
                          got=f"max difference {max(_diff(obs[r]['state'], saved) for r in stale):.3g}",
                          hint="ddp_model.module.load_state_dict(checkpoint['model']) (strict, the default: "
                          "strict=False silently skips keys that do not match, such as 'module.' ones)")
    wrong = [r for r, o in enumerate(obs) if o["epoch"] != float(epoch)]
    if wrong:
        got = obs[wrong[0]]["epoch"]
        raise CheckFailed(check, f"load_checkpoint did not return the saved epoch ({where})", ranks=wrong,
                          expected=f"{epoch} (checkpoint['epoch']) on every rank",
                          got=f"{got if isinstance(got, str) else int(got) if float(got).is_integer() else got}",
                          hint="return checkpoint['epoch']: the training loop goes on from there")
    passed(check)
