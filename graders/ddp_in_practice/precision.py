"""Checks for part 5 of exercise 2's practice notebook: one training step with gradient accumulation under
``no_sync()``, the forward under float16 autocast, the loss scaled with a GradScaler and the gradient clipped to a
max norm (``amp_clip_grads(ddp_model, optimizer, scaler, micro_batches, max_norm)``: the micro-batches' forward
and backward passes and the clipping; the grader's given code then calls ``scaler.step(optimizer)``,
``scaler.update()`` and ``optimizer.zero_grad()``).

One job (:func:`graders.ddp_in_practice.precision_harness.amp_harness`, shared by the three checks through
``checks.memo``) runs the student's step in three phases: ``free`` (a max_norm no gradient reaches: the weights
against the reference without clipping), ``scaling`` (a model whose first layer's gradients underflow in float16
unless the loss is scaled, and a call in which one rank's micro-batch overflows) and ``clipped`` (the check's
max_norm). Each check judges its own property and leaves the others' to them:

* :func:`check_amp_step`: float32 master weights, the linear layers computed in float16, bitwise equal ranks,
  each step's weights within the fp16 tolerance of one process's step on the global batch
  (:func:`weight_tolerance`), and the overflowing call's step skipped on every rank, the scale halved;
* :func:`check_clip`: the gradients the optimizer used are DDP's all-reduced gradient, divided by the loss scale,
  times min(1, max_norm / its norm), the same factor on every rank, and what each rank sent to the all-reduce
  was its unclipped accumulated gradient (no clipping per rank before the all-reduce, none per micro-step, none
  of the scaled gradients);
* :func:`check_amp_sync`: one all-reduce of the gradients per call, in the backward of the last micro-batch
  (torch's flight recorder counts them), and no other collective carrying more than a scalar.
"""

from __future__ import annotations

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common.ddp_model import make_net
from graders.ddp_in_practice.precision_evidence import _per_rank, judge_fp16, judge_sent
from graders.ddp_in_practice.precision_harness import (
    FP32_REL,
    FREE,
    INIT_SCALE,
    SCALING_LR,
    amp_harness,
    carried_scale,
    clip_factor,
    flat_grads,
    local_grads,
    one_step,
    unflatten,
    unscaled_twice,
)

#: float16's unit roundoff: 11 significant bits (10 stored, 1 implicit), round to nearest: relative error <= 2**-11
FP16_U = 2.0**-11


def weight_tolerance(lr: float, size: float, weight: float = 0.0) -> float:
    """How far, at most, float16 rounding can take a parameter of a right answer from the one-process reference
    after one step.

    Under autocast each linear layer rounds its inputs, weights and output to float16 (relative error <= u =
    2**-11 each) and accumulates in float32; its weight gradient is a float16 matmul too, rounded once per
    micro-batch on the ranks but once for the whole batch in the reference, and activations rounded after sums in
    another order can differ by one float16 step. An element of the accumulated gradient can therefore differ by
    up to about 4u x the mean |micro-batch gradient| (2u from the two roundings of the gradient, 2u from the
    activations); the clip factor, from a norm of such elements, by 4u relatively as well. Scaling the loss by a
    power of two is exact (while nothing underflows or overflows). One SGD step moves a weight by lr x factor x
    gradient, so its error is at most lr x 8u x factor x mean |g| (``size``, per parameter:
    :func:`graders.ddp_in_practice.precision_harness.one_step`), plus the float32 rounding of the weight itself
    (2**-24 relatively, twice: ``weight`` is the parameter's largest |w|)."""
    return lr * 8 * FP16_U * size + 2 * 2.0**-24 * weight + 1e-9


def _job(check, amp_clip_grads, world_size, k, size, lr, max_norm, seed):
    checks.require_written(check, amp_clip_grads=amp_clip_grads)
    hints = [("can only be called once", "the grader has registered the DDP model's communication hook: do not "
                                         "register one yourself"),
             ("timeout", "every rank must run the same backward passes with the same no_sync() pattern and the "
                         "same collectives: a rank that syncs when the others do not waits for them forever"),
             ("Attempting to unscale FP16 gradients", _CAST)]
    key = ("amp", amp_clip_grads, world_size, k, size, lr, max_norm, seed)
    return checks.memo(check, key, lambda: checks.run(
        check, amp_harness, world_size, args=(amp_clip_grads, k, size, lr, max_norm, seed), hints=hints,
        expected="amp_clip_grads returns on every rank, the gradients accumulated, scaled and clipped").values)


_CAST = ("the model's weights were cast to a 16-bit type (ddp_model.half(), .to(torch.float16), .bfloat16()): keep "
         "the float32 master weights and let torch.autocast(device_type, dtype=torch.float16) run the forward in "
         "float16 (the GradScaler refuses to unscale float16 gradients). Casting a model after DDP wrapped it also "
         "stops DDP's gradient all-reduce without an error (measured, torch 2.13): the ranks drift apart")


def _cast(obs) -> list[int]:
    """The ranks whose parameters were not float32 after some call of the step."""
    return [r for r, o in enumerate(obs) if any(c["dtypes"] != ["float32"] for c in o["calls"])]


def _phase(job, phase):
    return [o[phase] for o in job]


def check_amp_step(amp_clip_grads, *, world_size=2, k=4, size=3, lr=0.1, max_norm=0.5, seed=0):
    """With a max_norm no gradient reaches (each call followed by the given scaler.step, scaler.update, zero_grad):
    the parameters stay float32 (master weights) and the linear layers ran in float16 (autocast); the ranks end
    bitwise equal; each step's weights are within :func:`weight_tolerance` of one process's step on the global batch
    (float16 autocast, float32 weights, the loss scaled by the scaler's power of two); and in the call where one
    rank's micro-batch overflows float16, no rank steps (the weights unchanged) and the next call runs at half the
    scale."""
    check = "check_amp_step"
    job = _job(check, amp_clip_grads, world_size, k, size, lr, max_norm, seed)
    seeds = _data_seeds(job)
    where = f"{world_size} ranks, {k} micro-batches per step"
    for phase in ("free", "scaling"):
        _judge_given(check, _phase(job, phase), where)
    obs = _phase(job, "free")
    plain = [r for r, o in enumerate(obs) if any(c["linear_dtypes"] != ["float16"] for c in o["calls"])]
    if plain:
        got = obs[plain[0]]["calls"][0]["linear_dtypes"]
        bf16 = got == ["bfloat16"]
        raise CheckFailed(check, f"the linear layers computed in bfloat16, not float16 ({where})" if bf16 else
                          f"the linear layers did not compute in float16 ({where})", ranks=plain,
                          expected="every forward of the linear layers under torch.autocast(..., dtype=torch.float16): "
                          "outputs in float16", got=f"linear layer outputs on rank {plain[0]}: {got}",
                          hint="this part asks for float16 mixed precision, whose small range is why the loss is "
                          "scaled: dtype=torch.float16 in the autocast context" if bf16 else
                          "run each micro-batch's forward (the model call and the loss) inside a torch.autocast "
                          "context for the batch's device type with dtype float16, its backward after the context")
    judge_fp16(check, obs, "free", k, size, seeds, where)
    for phase in ("free", "scaling"):
        states = [o["state"] for o in _phase(job, phase)]
        differ = [r for r in range(1, world_size)
                  if any(not torch.equal(states[0][n], states[r][n]) for n in states[0])]
        stepped = [bool(o["calls"][0]["at_step"]) for o in _phase(job, phase)]
        if differ and phase == "scaling" and len(set(stepped)) > 1:  # the overflowing call: some ranks stepped
            raise CheckFailed(check, f"the ranks disagreed on skipping the step whose gradients overflowed ({where})",
                              ranks=range(world_size), expected="in call 1 of the scaling phase, every rank's "
                              "scaler.step skips the step: DDP's all-reduce carries one rank's inf/NaN to all",
                              got=f"stepped on ranks {[r for r, s in enumerate(stepped) if s]}, skipped on ranks "
                              f"{[r for r, s in enumerate(stepped) if not s]}", hint="let the scaler look at the "
                              "gradients only after the last backward: before DDP's all-reduce each rank's gradients "
                              "are its own, finite on one rank and not on another")
        if differ:
            raise CheckFailed(check, f"the ranks end with different weights ({where})", ranks=differ,
                              expected="bitwise the same weights on every rank",
                              hint="let DDP all-reduce in the last micro-batch's backward (outside no_sync()), and "
                              "step every rank with the same gradients")
    _judge_overflow(check, _phase(job, "scaling"), where)
    for phase, calls, lr_ in (("free", (0, 1), lr), ("scaling", (1,), SCALING_LR)):
        _judge_weights(check, _phase(job, phase), phase, calls, lr_, k, size, seeds, where)
    passed(check)


def _judge_given(check, obs, where):
    """The given code (scaler.step, scaler.update) ran without an error, and the optimizer stepped at most once."""
    for rank, o in enumerate(obs):
        for call, c in enumerate(o["calls"]):
            error = c["given_error"]
            if error and "FP16 gradients" in error:
                raise CheckFailed(check, f"the master weights are not float32 ({where})", ranks=[rank],
                                  expected="float32 parameters and gradients (the GradScaler unscales those only)",
                                  got=f"call {call + 1}, the given scaler.step(optimizer): {error}", hint=_CAST)
            if error and "No inf checks were recorded" in error:  # unscale_ found no gradient in .grad
                raise CheckFailed(check, f"the given scaler.step found no gradients in .grad ({where})", ranks=[rank],
                                  expected=f"in call {call + 1}, amp_clip_grads ends with the clipped gradients in "
                                  ".grad, for the given scaler.step(optimizer)", got=error,
                                  hint="leave the step, the scaler's update and zero_grad to the given code: after any "
                                  "of them inside amp_clip_grads, nothing is left for the given step")
            if error:
                twice = "already been called" in error
                raise CheckFailed(check, "the step was taken inside amp_clip_grads" if twice else
                                  f"the given code (scaler.step(optimizer), scaler.update()) failed ({where})",
                                  ranks=[rank], expected=f"in call {call + 1}, the given scaler.step and "
                                  "scaler.update run once each, after amp_clip_grads returned", got=error,
                                  hint="leave the step, the scaler's update and zero_grad to the given code: "
                                  "amp_clip_grads ends with the clipped gradients in .grad" if twice else
                                  "scale each micro-batch's loss with the given scaler before its backward, and "
                                  "leave scaler.step and scaler.update to the given code")
            if len(c["at_step"]) > 1:
                raise CheckFailed(check, f"the optimizer stepped {len(c['at_step'])} times in one call ({where})",
                                  ranks=[rank], expected=f"in call {call + 1}, one step: the given "
                                  "scaler.step(optimizer)", got=f"{len(c['at_step'])} optimizer steps",
                                  hint="leave the step to the given code: amp_clip_grads ends with the clipped "
                                  "gradients in .grad, optimizer.step() or scaler.step() inside it steps twice")
    cast = _cast(obs)
    if cast:
        raise CheckFailed(check, f"the master weights are not float32 ({where})", ranks=cast,
                          expected="every parameter float32 after every call (autocast computes in float16, the "
                          "weights and the optimizer's step stay float32)",
                          got=f"parameter dtypes on rank {cast[0]}: {obs[cast[0]]['calls'][-1]['dtypes']}", hint=_CAST)


def _judge_overflow(check, obs, where):
    """Call 1 of the scaling phase overflows on one rank: no rank stepped, the weights are unchanged on every rank, and
    call 2 ran at half the scale."""
    last = len(obs) - 1
    for rank, o in enumerate(obs):
        c, after = o["calls"][0], o["calls"][1]
        moved = any(not torch.equal(c["start"][n], after["start"][n]) for n in c["start"])
        if c["at_step"] or moved:
            raise CheckFailed(check, f"the step of a call whose gradients overflowed float16 was not skipped ({where})",
                              ranks=[rank], expected=f"in call 1, rank {last}'s micro-batch overflows float16: the "
                              "all-reduce carries its inf/NaN to every rank, and every rank's scaler.step skips "
                              "the step (the weights unchanged)",
                              got=f"the optimizer stepped: {bool(c['at_step'])}; the weights changed: {moved}",
                              hint="scale the loss with the given scaler and leave the gradients as DDP's all-reduce "
                              "left them (clipped): the scaler finds the non-finite values when it unscales them; "
                              "gradients made finite again, or a step of your own, defeat it")
        if after["scale"] != c["scale"] / 2:
            twice = after["scale"] == c["scale"] / 4
            raise CheckFailed(check, "the loss scale was halved twice after the overflow: scaler.update() ran in "
                              f"amp_clip_grads too ({where})" if twice else
                              f"the loss scale was not halved after the overflow ({where})", ranks=[rank],
                              expected=f"call 2 at scale {c['scale'] / 2:g}", got=f"scale {after['scale']:g}",
                              hint="leave the scaler's update to the given code")


def _judge_weights(check, obs, phase, calls, lr, k, size, seeds, where):
    """After each of ``calls``, the weights within :func:`weight_tolerance` of one process's step from the call's
    weights on the global batch, at the scale the scaler had (float16 autocast, float32 weights)."""
    for call in calls:
        c = obs[0]["calls"][call]
        after = obs[0]["calls"][call + 1]["start"] if call + 1 < len(obs[0]["calls"]) else obs[0]["state"]
        per_rank = _per_rank(phase, seeds, call, k, size)
        scale = INIT_SCALE / (2 if phase == "scaling" else 1)  # after the overflow: halved
        reference, sizes = one_step(c["start"], per_rank, lr, FREE, scale)
        worst = max(reference, key=lambda n: (after[n] - reference[n]).abs().max().item()
                    / weight_tolerance(lr, sizes[n], reference[n].abs().max().item()))
        diff = (after[worst] - reference[worst]).abs().max().item()
        tol = weight_tolerance(lr, sizes[worst], reference[worst].abs().max().item())
        if diff <= tol:
            continue

        def near(state, after=after, sizes=sizes):
            return all((after[n] - state[n]).abs().max().item()
                       <= 2 * weight_tolerance(lr, sizes[n], state[n].abs().max().item()) for n in state)

        start = c["start"]
        moved, right = (torch.cat([(s[n] - start[n]).reshape(-1) for n in start]) for s in (after, reference))
        m = float(moved @ right / (right @ right).clamp_min(1e-30))  # the step taken, as a multiple of the right one
        hint = ("for each micro-batch: its forward and loss under float16 autocast, the loss / k scaled with the "
                "given scaler, its backward (the first k - 1 inside no_sync()); then clip the true gradients "
                "(the given code takes the step)")
        if not c["at_step"]:
            problem = "the given scaler.step skipped the step: the gradients held inf or NaN"
            hint = ("this call's micro-batches overflow float16 nowhere: scale each loss with the given scaler, "
                    "whose scale is a power of two these gradients fit, and nothing else")
        elif all(g is None or not g.any() for g in c["at_step"][-1]["grads"].values()):
            problem = "the optimizer stepped with no gradients: .grad was emptied before the given step"
            hint = "leave zero_grad to the given code, which runs it after the step"
        elif near({n: start[n] + m * (reference[n] - start[n]) for n in start}) and abs(m * scale - 1) < 0.05:
            carried = carried_scale(c, per_rank, k)
            problem = ("the loss was not scaled: the given scaler.step divided unscaled gradients by the scale"
                       if abs(carried - 1) < 0.05 else "the gradients were divided by the scale twice: in "
                       f"amp_clip_grads (DDP's all-reduce carried {carried:.4g} x them), then by the given scaler.step")
            hint = ("multiply each micro-batch's loss by the given GradScaler's scale (its scale method) before its "
                    "backward; the scaler divides the gradients by it again before the step" if abs(carried - 1) < 0.05
                    else "the given scaler.step divides the gradients by its scale unless the given scaler itself "
                    "unscaled them in this step (PyTorch's AMP examples, 'Working with Unscaled Gradients'): not by "
                    "hand, nor with a scaler of your own")
        elif near({n: start[n] + m * (reference[n] - start[n]) for n in start}):
            problem = (f"the step is {k} x too large" if abs(m - k) < 0.05 * k
                       else f"the step is {m:.3g} x the right one")
            hint = (f"divide each micro-batch's loss by {k}, so the accumulated gradient is the mean over the "
                    "micro-batches, not their sum" if abs(m - k) < 0.05 * k else "scale each loss with the given "
                    "scaler: its scale changes (halved after an overflow), so a scale of your own, a number or one "
                    "read once, is off by that factor" if abs(m * scale / INIT_SCALE - 1) < 0.05 else hint)
        elif phase == "scaling" and near(one_step(start, per_rank, lr, FREE, 1.0)[0]):
            problem = "the gradients underflowed in float16: the loss was not scaled"
            hint = ("scale each micro-batch's loss with the given GradScaler before its backward: this model's "
                    "first-layer gradients are ~1e-6, below float16's normal range, and round to zero unless scaled")
        else:
            problem = "the weights differ from one process's step on the global batch by more than float16 rounding"
        raise CheckFailed(check, f"{problem} ({where}, call {call + 1} of the {phase} phase)",
                          ranks=range(len(obs)), expected=f"{worst} within {tol:.2g} of the reference (lr x 8 x "
                          "2**-11 x the gradients' size: float16 keeps 11 significant bits)",
                          got=f"max difference {diff:.3g}", hint=hint)


def _data_seeds(job: list[dict]) -> tuple[int, ...]:
    """Each rank's data seed, drawn by that rank alone (:func:`precision_harness.amp_harness`)."""
    return tuple(int(o["data_seed"]) for o in job)


def check_clip(amp_clip_grads, *, world_size=2, k=4, size=3, lr=0.1, max_norm=0.5, seed=0):
    """The gradients the optimizer used are the all-reduced gradient (what DDP's all-reduce returned) divided by the
    loss scale, times min(1, max_norm / (its norm + 1e-6)), on every rank (1e-4 relative: float32); what each rank
    sent to that all-reduce is its own unclipped accumulated gradient, a multiple of the sum of its micro-batches'
    gradients within float16 rounding (4 x 2**-11 x their sum of absolute values); the ranks end bitwise equal,
    each step's weights those of one process's clipped step within :func:`weight_tolerance`."""
    check = "check_clip"
    job = _job(check, amp_clip_grads, world_size, k, size, lr, max_norm, seed)
    obs, seeds = _phase(job, "clipped"), _data_seeds(job)
    where = f"{world_size} ranks, {k} micro-batches per step, max_norm={max_norm:g}"
    cast = _cast(obs)
    if cast:
        raise CheckFailed(check, f"the weights were cast to a 16-bit type, and DDP's all-reduce then stopped ({where})",
                          ranks=cast, expected="float32 parameters, DDP's all-reduce in every step", hint=_CAST)
    model = make_net(0)
    order = [n for n, _ in model.named_parameters()]
    shapes = dict(model.named_parameters())
    steps = len(obs[0]["calls"])
    applied = []  # per call: the loss scale the all-reduced gradients carry
    for call in range(steps):  # what the all-reduces carried first, then what each call's clip did with it
        inputs = {}  # rank -> (the call's weights, its micro-batches)
        for rank, o in enumerate(obs):
            c = o["calls"][call]
            if not c["synced"] or "reduced" not in c["synced"][-1]:
                raise CheckFailed(check, f"DDP did not all-reduce the gradients in call {call + 1} ({where})",
                                  ranks=[rank], expected="DDP's all-reduce in the last micro-batch's backward, then "
                                  "the clipping of its result", got="no all-reduce by DDP's hook in the call",
                                  hint="run the last micro-batch's forward and backward outside no_sync(): DDP "
                                  "all-reduces there; clip after it (gradients synced by hand are not DDP's)")
            inputs[rank] = c["start"], _per_rank("clipped", seeds, call, k, size)[rank]
        found = None
        for dtype in (torch.float16, torch.bfloat16, None):
            # where the clip is concerned, any forward dtype passes (the dtype is check_amp_step's)
            try:
                found = judge_sent(check, obs, call, local_grads(inputs, k, dtype), order, shapes, max_norm, where)
                break
            except CheckFailed as error:
                first = found or error
                found = first
        if isinstance(found, CheckFailed):
            raise found
        applied.append(found)
    _judge_early(check, obs, where)
    _judge_unscaled(check, _phase(job, "free"), obs, order, shapes, max_norm, where)
    twice = unscaled_twice(job[0]["free"]["calls"], _per_rank("free", seeds, 0, k, size), lr)
    for call in range(steps):
        _judge_clipped(check, obs, call, order, shapes, max_norm, applied[call], twice, where)
    states = [o["state"] for o in obs]
    differ = [r for r in range(1, world_size) if any(not torch.equal(states[0][n], states[r][n]) for n in states[0])]
    if differ:
        raise CheckFailed(check, f"the ranks end with different weights ({where})", ranks=differ,
                          expected="bitwise the same weights on every rank: the same clip factor everywhere",
                          hint="clip after DDP's all-reduce, on every rank, with the norm of the synced gradients")
    if twice or any(len(c["at_step"]) != 1 or c["given_error"] or abs(a - c["scale"]) > 1e-2 * c["scale"]
                    or c["linear_dtypes"] != ["float16"] for c, a in zip(obs[0]["calls"], applied)):
        passed(check)  # an extra step, a failing given step, a loss not scaled or unscaled twice, another dtype:
        # check_amp_step's business
        return
    for call in range(steps):
        c = obs[0]["calls"][call]
        after = obs[0]["calls"][call + 1]["start"] if call + 1 < steps else obs[0]["state"]
        reference, sizes = one_step(c["start"], _per_rank("clipped", seeds, call, k, size), lr, max_norm, c["scale"])
        for n in reference:
            diff = (after[n] - reference[n]).abs().max().item()
            tol = weight_tolerance(lr, sizes[n], reference[n].abs().max().item())
            if diff > tol:  # the gradients were clipped right, yet the weights are not the clipped step's
                raise CheckFailed(check, f"the weights differ from one process's clipped step by more than float16 "
                                  f"rounding explains ({where})", ranks=range(world_size),
                                  expected=f"after call {call + 1}, {n} within {tol:.2g} of the reference (lr x 8 x "
                                  "2**-11 x the clipped gradients' size)", got=f"max difference {diff:.3g}",
                                  hint="clip once, after the last backward, and leave the clipped gradients in "
                                  ".grad for the given step")
    passed(check)


def _judge_early(check, obs, where):
    """No collective carrying more than a scalar ran before DDP's all-reduce (torch's flight recorder, read through
    references the harness bound before any student code): each rank's data is its own secret, so a clip factor
    worked out before the all-reduce needs the other ranks' gradients sent some other way first."""
    for rank, o in enumerate(obs):
        for call, c in enumerate(o["calls"]):
            if c.get("early"):
                op, n = c["early"][0]
                raise CheckFailed(check, f"a collective of its own carried the gradients before DDP's all-reduce "
                                  f"({where})", ranks=[rank], expected=f"in call {call + 1}, nothing but scalars "
                                  "sent before DDP's all-reduce of the gradients: the clip comes after it, from "
                                  "the synced gradients", got=f"rank {rank} ran {op} of {n} values before it",
                                  hint="clip after the last micro-batch's backward, with the norm of the all-reduced "
                                  "gradients (clip_grad_norm_): a clip factor worked out beforehand, from gradients "
                                  "gathered by hand, is not the synced gradient's")


def _judge_unscaled(check, free, clipped, order, shapes, max_norm, where):
    """In the first call, what each rank sent to DDP's all-reduce is the same with the check's max_norm as with one no
    gradient reaches (the job's two phases start from the same weights, with the same micro-batches): the clip comes
    after the all-reduce. A rank that scales its losses or gradients before it, by a factor worked out beforehand
    (from the other ranks' data recomputed on this rank, say), sends that multiple, which an all-reduce of multiples
    and a clip factor of about 1 afterwards would otherwise pass for the clipped global gradient."""
    for rank, (a, b) in enumerate(zip(free, clipped)):
        before, after = a["calls"][0]["synced"], b["calls"][0]["synced"]
        if len(before) != 1 or len(after) != 1:
            continue  # synced more than once: check_amp_sync's business
        plain = unflatten(before[0]["sent"], before[0]["params"], order, shapes)
        sent = unflatten(after[0]["sent"], after[0]["params"], order, shapes)
        if plain.shape == sent.shape and bool(((sent - plain).abs() <= FP32_REL * plain.abs().max() + 1e-7).all()):
            continue
        ratio = float(sent @ plain / (plain @ plain).clamp_min(1e-30))
        raise CheckFailed(check, f"each rank scaled its gradients before DDP's all-reduce ({where})", ranks=[rank],
                          expected=f"in call 1, what rank {rank} sends to DDP's all-reduce with max_norm={max_norm:g} "
                          "is what it sends when no gradient reaches max_norm (the same weights and micro-batches): "
                          "its unclipped accumulated gradient", got=f"{ratio:.4g} x that",
                          hint="clip after the last micro-batch's backward, with the norm of the all-reduced gradients "
                          "(clip_grad_norm_ does it): a clip factor worked out before the all-reduce (from this rank's "
                          "own gradients, or from the other ranks' data recomputed here) is not the synced gradient's")


def _judge_clipped(check, obs, call, order, shapes, max_norm, carried, twice, where):
    """The step used c x the all-reduced gradient / the loss scale, c = min(1, max_norm / (its norm + eps)), on every
    rank. ``twice``: the free phase's step used the true gradient / the scale (a loss not scaled, or gradients
    unscaled in amp_clip_grads and again by the given scaler.step: check_amp_step's business); then the clip is
    judged on the all-reduced gradient / ``carried`` (the multiple of the true one it carries, :func:`~graders.ddp_in_practice.precision_evidence.judge_sent`)
    and the step expected to use the clipped gradient / the scale."""
    for rank, o in enumerate(obs):
        c = o["calls"][call]
        record = c["synced"][-1]
        scale = c["scale"]
        if not c["at_step"]:
            raise CheckFailed(check, f"the given scaler.step skipped the step: the gradients were not finite ({where})",
                              ranks=[rank], expected=f"in call {call + 1}, a step with the clipped gradients (this "
                              "call's data overflow nowhere)", got="no optimizer step",
                              hint="scale each loss with the given scaler, and clip after unscaling the gradients")
        synced = unflatten(record["reduced"], record["params"], order, shapes) / (carried if twice else scale)
        used = flat_grads(c["at_step"][-1]["grads"], order, shapes) * (scale if twice else 1.0)
        norm = float(synced.norm())
        want = clip_factor(norm, max_norm)
        applied = float(used @ synced / (synced @ synced).clamp_min(1e-30))
        if ((used - want * synced).abs() <= FP32_REL * synced.abs().max() + 1e-7).all():
            continue
        if not used.any():
            problem = f"the optimizer stepped with no gradients: .grad was emptied before the given step ({where})"
            hint = "leave zero_grad to the given code, which runs it after the step"
        elif twice and abs(applied - 1) <= FP32_REL and norm > max_norm:
            problem = (f"the clip saw the gradients divided by the loss scale twice (norm {norm / scale:.3g}, below "
                       f"max_norm), so it clipped nothing ({where})")
            hint = ("unscale once: the given scaler's unscale_ divides by the scale, and a division of your own on top "
                    "of it leaves the clip (and the step) with gradients the scale times too small")
        elif abs(applied - 1) <= FP32_REL and norm > max_norm:
            problem = f"the gradients the optimizer used were not clipped after DDP's all-reduce ({where})"
            hint = ("after the last backward (outside no_sync()), clip the synced gradients of all the model's "
                    "parameters to max_norm: clip_grad_norm_ does it, and returns their global norm")
        else:
            problem = f"the clip factor is not the one of the all-reduced gradient's norm ({where})"
            hint = ("compute the norm after DDP's all-reduce, from the synced gradients of every parameter (the same "
                    "on every rank): a norm taken earlier, or of this rank's own gradients, gives each rank its own "
                    "factor (clip_grad_norm_ after the last backward does it right)")
            world_size, k = len(obs), c["forwards"]
            for times, named, why in (
                    (scale, f"the scaled gradients ({scale:g} x the true ones)",
                     "the gradients in .grad are the scaled ones until they are unscaled: clip_grad_norm_ on them "
                     f"sees a norm {scale:g} x too large; clip the true gradients (PyTorch's AMP examples, "
                     "'Working with Unscaled Gradients'), then the given scaler.step does not unscale again"),
                    (world_size ** 0.5, "the synced gradients' norm summed over the ranks once more",
                     f"after DDP's all-reduce every rank holds the same gradients, so summing their squares over the "
                     f"ranks counts them {world_size} times: the local norm of the synced gradients is the global one"),
                    (k, f"{k} x the gradient", f"the micro-batches' losses were summed and clipped, then divided by "
                     f"{k}: scale the loss (or the gradients) first, then clip")):
                if times > 1 and abs(applied - clip_factor(norm * times, max_norm)) <= 1e-3 * max(applied, 1e-12):
                    problem, hint = f"the clip factor is that of {named} ({where})", why
                    break
        multiple_of = ((used - applied * synced).abs() <= FP32_REL * synced.abs().max() + 1e-7).all()
        raise CheckFailed(check, problem, ranks=[rank],
                          expected=f"in call {call + 1}, the all-reduced gradient / the scale (norm {norm:.4g}) times "
                          f"min(1, {max_norm:g} / norm) = {want:.4g}",
                          got=f"the optimizer stepped with {applied:.4g} x the all-reduced gradient / the scale"
                          if multiple_of else "the optimizer stepped with gradients that are no multiple of the "
                          "all-reduced ones", hint=hint)


def check_amp_sync(amp_clip_grads, *, world_size=2, k=4, size=3, lr=0.1, max_norm=0.5, seed=0):
    """Each call all-reduces the gradients once, in the backward of the last micro-batch (torch's flight
    recorder counts the gradient-sized all-reduces the process group ran; DDP's hook says in which
    backward), and runs no other collective carrying more than a scalar (a loss or a norm may be shared)."""
    check = "check_amp_sync"
    job = _job(check, amp_clip_grads, world_size, k, size, lr, max_norm, seed)
    where = f"{world_size} ranks, {k} micro-batches per step"
    cast = _cast([o["clipped"] for o in job])
    for phase in ("clipped", "free", "scaling"):
        for rank, o in enumerate(o[phase] for o in job):
            for call, c in enumerate(o["calls"]):
                forwards, at = c["forwards"], [s["at"] for s in c["synced"]]
                count = len(at) if c["grad_reduces"] is None else c["grad_reduces"]
                if count == 1 and at == [forwards] and forwards >= 1 and not c["others"]:
                    continue
                got = (f"call {call + 1}: {count} all-reduce(s) of the gradients, DDP's hook saw them after forwards "
                       f"{at} of {forwards}; other collectives: {c['others'] or 'none'}")
                if rank in cast:
                    problem, hint = f"DDP did not all-reduce the gradients once per call ({where})", _CAST
                elif count > 1:
                    problem = f"the gradients were all-reduced {count} times in one call ({where})"
                    hint = (f"run the first {k - 1} micro-batches (forward and backward) inside the DDP model's "
                            "no_sync() context, and only the last outside it")
                elif count == 0 or not at:
                    problem = f"DDP never all-reduced the gradients in one call ({where})"
                    hint = ("the last micro-batch's forward and backward must run outside no_sync(): DDP decides in "
                            "the forward whether the next backward syncs; syncing by hand skips DDP's bucketed "
                            "all-reduce")
                elif c["others"]:
                    problem = f"other collectives than DDP's all-reduce carried more than a scalar ({where})"
                    hint = ("after DDP's all-reduce the gradients are the same on every rank: clip them as they are, "
                            "without sending them again (a norm of the synced gradients needs no communication)")
                else:
                    problem = f"DDP all-reduced the gradients before the last micro-batch ({where})"
                    hint = ("sync in the last micro-batch, not an earlier one: the gradients added after the "
                            "all-reduce stay on their rank; use no_sync() for the first k - 1 micro-batches")
                raise CheckFailed(check, problem, ranks=[rank], expected=f"1 all-reduce per call, in the backward of "
                                  f"micro-batch {k} of {k}, and no other collective but scalars", got=got, hint=hint)
    passed(check)
