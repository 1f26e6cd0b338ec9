"""Checks for part 5 of exercise 2's practice notebook: one training step with gradient accumulation under
``no_sync()``, the forward under bf16 autocast, and the gradient clipped to a max norm
(``amp_clip_grads(ddp_model, micro_batches, max_norm)``: the micro-batches' forward and backward passes and
the clipping; the grader's given code then takes the optimizer step and zeroes the gradients).

One job (:func:`graders.ddp_in_practice.precision_harness.amp_harness`, shared by the three checks through
``checks.memo``) runs the student's step in two phases: once with a max_norm no gradient reaches (clipping
is then a no-op, so the weights can be judged against the reference without it) and once with the
check's max_norm. Each check judges its own property and leaves the others' to them:

* :func:`check_amp_step`: float32 master weights, the linear layers computed in bfloat16, bitwise equal ranks,
  and the weights within the bf16 tolerance of one process on the global batch (:func:`weight_tolerance`);
* :func:`check_clip`: the gradients the optimizer used are DDP's all-reduced gradient scaled by
  min(1, max_norm / its norm), the same factor on every rank, and what each rank sent to the all-reduce
  was its unclipped accumulated gradient (no clipping per rank before the all-reduce, none per micro-step;
  in the first call, the very values it sends when no gradient reaches max_norm, so no factor worked out
  before the all-reduce, from the other ranks' data recomputed locally say, passes for the clip);
* :func:`check_amp_sync`: one all-reduce of the gradients per call, in the backward of the last micro-batch
  (torch's flight recorder counts them), and no other collective carrying more than a scalar.
"""

from __future__ import annotations

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common.ddp_model import make_net
from graders.ddp_in_practice.precision_harness import (
    FREE,
    amp_batches,
    amp_harness,
    amp_reference,
    clip_factor,
    micro_grads,
)

#: bf16's unit roundoff: 8 significant bits (7 stored, 1 implicit), round to nearest: relative error <= 2**-8
BF16_U = 2.0**-8
#: relative agreement of float32 computations of one value in another order (a clip factor, a scaled gradient)
FP32_REL = 1e-4


def weight_tolerance(lr: float, scale: float) -> float:
    """How far, at most, bf16 rounding can take the weights of a right answer from the one-process reference.

    Under autocast each linear layer rounds its inputs, weights and output to bf16 (relative error <= u =
    2**-8 each) and accumulates in float32; its weight gradient is a bf16 matmul too, rounded once per
    micro-batch on the ranks but once for the whole batch in the reference, and activations rounded after
    sums in another order can differ by one bf16 step. An element of the accumulated gradient can therefore
    differ by up to about 4u x the mean |micro-batch gradient| (2u from the two roundings of the gradient,
    2u from the activations); the clip factor, from a norm of such elements, by 4u relatively as well. One
    SGD step moves a weight by lr x factor x gradient, so its error is at most lr x 8u x factor x mean |g|:
    ``scale`` sums factor x max mean |g| over the steps (:func:`amp_reference`). Measured here (2-3 ranks,
    torch 2.13 CPU) a right answer stays below a tenth of it."""
    return lr * 8 * BF16_U * scale + 1e-6


def _job(check, amp_clip_grads, world_size, k, size, steps, lr, max_norm, seed):
    checks.require_written(check, amp_clip_grads=amp_clip_grads)
    hints = [("can only be called once", "the grader has registered the DDP model's communication hook: do not "
                                         "register one yourself"),
             ("timeout", "every rank must run the same backward passes with the same no_sync() pattern and the "
                         "same collectives: a rank that syncs when the others do not waits for them forever")]
    key = ("amp", amp_clip_grads, world_size, k, size, steps, lr, max_norm, seed)
    return checks.memo(check, key, lambda: checks.run(
        check, amp_harness, world_size, args=(amp_clip_grads, k, size, steps, lr, max_norm, seed), hints=hints,
        expected="amp_clip_grads returns on every rank, the gradients accumulated and clipped").values)


_CAST = ("the model's weights were cast to bfloat16 (ddp_model.to(torch.bfloat16), .bfloat16(), .half()): keep the "
         "float32 master weights and let torch.autocast(device_type, dtype=torch.bfloat16) run the forward in bf16. "
         "Casting a model after DDP wrapped it also stops DDP's gradient all-reduce without an error (measured, "
         "torch 2.13): the ranks drift apart")


def _cast(obs) -> list[int]:
    """The ranks whose parameters were not float32 after some call of the step."""
    return [r for r, o in enumerate(obs) if any(c["dtypes"] != ["float32"] for c in o["calls"])]


def check_amp_step(amp_clip_grads, *, world_size=2, k=4, size=3, steps=2, lr=0.1, max_norm=0.5, seed=0):
    """With a max_norm no gradient reaches (each call followed by the given optimizer step): the parameters stay
    float32 (master weights) and the linear layers ran in bfloat16 (autocast); the ranks end bitwise equal; and the
    weights are within :func:`weight_tolerance` of one process's steps on the global batch (bf16 autocast,
    float32 weights)."""
    check = "check_amp_step"
    job = _job(check, amp_clip_grads, world_size, k, size, steps, lr, max_norm, seed)
    obs, seeds = [o["free"] for o in job], _data_seeds(job)
    where = f"{world_size} ranks, {k} micro-batches per step, {steps} calls"
    cast = _cast(obs)
    if cast:
        raise CheckFailed(check, f"the master weights are not float32 ({where})", ranks=cast,
                          expected="every parameter float32 after every call (autocast computes in bf16, the weights "
                          "and the optimizer's step stay float32)",
                          got=f"parameter dtypes on rank {cast[0]}: {obs[cast[0]]['calls'][-1]['dtypes']}", hint=_CAST)
    plain = [r for r, o in enumerate(obs) if any(c["linear_dtypes"] != ["bfloat16"] for c in o["calls"])]
    if plain:
        raise CheckFailed(check, f"the linear layers did not compute in bfloat16 ({where})", ranks=plain,
                          expected="every forward of the linear layers under torch.autocast(..., dtype=torch.bfloat16): "
                          "outputs in bfloat16",
                          got=f"linear layer outputs on rank {plain[0]}: {obs[plain[0]]['calls'][0]['linear_dtypes']}",
                          hint="run each micro-batch's forward (the model call and the loss) inside a torch.autocast "
                          "context for the batch's device type with dtype bfloat16, its backward after the context")
    _judge_bf16(check, obs, k, size, seeds, where)
    states = [o["state"] for o in obs]
    differ = [r for r in range(1, world_size) if any(not torch.equal(states[0][n], states[r][n]) for n in states[0])]
    if differ:
        raise CheckFailed(check, f"the ranks end with different weights ({where})", ranks=differ,
                          expected="bitwise the same weights on every rank",
                          hint="let DDP all-reduce in the last micro-batch's backward (outside no_sync()), and "
                          "step every rank with the same gradients")
    reference, scale = amp_reference(world_size, k, size, steps, lr, FREE, seed, seeds)
    tol = weight_tolerance(lr, scale)
    diff = max((states[0][n].float() - reference[n]).abs().max().item() for n in reference)
    if diff > tol:
        summed, _ = amp_reference(world_size, k, size, steps, lr * k, FREE, seed, seeds)
        hint = (f"the step is {k} x too large: divide each micro-batch's loss by {k}, so the accumulated gradient "
                "is the mean over the micro-batches, not their sum"
                if max((states[0][n].float() - summed[n]).abs().max().item() for n in summed) <= tol * k else
                "for each micro-batch: its forward and loss under autocast, (loss / k).backward() (the first k - 1 "
                "inside no_sync()); then clip (the given code takes the step)")
        raise CheckFailed(check, f"the weights differ from one process's steps on the global batch by more than bf16 "
                          f"rounding explains ({where})", ranks=range(world_size),
                          expected=f"within {tol:.2g} of the reference (lr x 8 x 2**-8 x the gradients' size: "
                          "bf16 keeps 8 significant bits)", got=f"max difference {diff:.3g}", hint=hint)
    passed(check)


def _residual(values: torch.Tensor, target: torch.Tensor) -> float:
    """How far ``values`` is from the nearest multiple of ``target`` (a loss weighted otherwise is a multiple)."""
    a = float(values @ target / (target @ target).clamp_min(1e-30))
    return float((values - a * target).norm())


def _data_seeds(job: list[dict]) -> tuple[int, ...]:
    """Each rank's data seed, drawn by that rank alone (:func:`graders.ddp_in_practice.precision_harness.amp_harness`)."""
    return tuple(int(o["data_seed"]) for o in job)


def _judge_bf16(check, obs, k, size, seeds, where):
    """The gradients the optimizer used carry bf16's rounding: nearer (by half at least) to the all-reduced gradient
    of a bf16-autocast forward than to a float32 forward's, recomputed here at the call's weights. This is the
    effect of autocast, which the linear layers' recorded dtypes (in the student's reach) only report."""
    world_size = len(obs)
    model = make_net(0)
    for call in range(len(obs[0]["calls"])):
        c = obs[0]["calls"][call]
        used = c["at_step"][0]["grads"]
        used = torch.cat([(torch.zeros_like(p) if used[n] is None else used[n]).reshape(-1)
                          for n, p in model.named_parameters()])
        per_rank = [amp_batches(seeds[rank], rank, call, k, size) for rank in range(world_size)]
        bf16, fp32 = (sum(g for batches in per_rank for g in micro_grads(c["start"], batches, k, bf16=b)) / world_size
                      for b in (True, False))
        near, far = _residual(used, bf16), _residual(used, fp32)
        # each rank's micro-batches through the model as one batch: the same numbers but for bf16's rounding, whose
        # pattern (the rounding of that one batch's forward) tells it from the micro-batches' own
        whole = sum(micro_grads(c["start"], [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))],
                                1)[0] for batches in per_rank) / world_size
        together = _residual(used, whole)
        if together < 0.5 * min(near, far):
            raise CheckFailed(check, f"the micro-batches went through the model as one batch ({where})",
                              ranks=range(world_size), expected=f"in call {call + 1}, the gradients of the {k} "
                              "micro-batches' forwards, each under bf16 autocast on its own (as the grader recomputes "
                              "them at the call's weights)",
                              got=f"{together:.3g} from one forward of all of them, {near:.3g} from the micro-batches' "
                              "own", hint="for each micro-batch: its forward and loss under autocast, (loss / k)."
                              "backward(), the first k - 1 inside no_sync(): the micro-batches are there because the "
                              "whole batch at once does not fit")
        if near > 0.5 * far:
            raise CheckFailed(check, f"the gradients do not carry bf16's rounding: the forward ran in float32 ({where})",
                              ranks=range(world_size), expected=f"in call {call + 1}, the gradients of a forward under "
                              "bf16 autocast (as the grader recomputes them at the call's weights)",
                              got=f"{near:.3g} from the bf16 forward's gradients, {far:.3g} from a float32 forward's",
                              hint="run each micro-batch's forward (the model call and the loss) inside a "
                              "torch.autocast context for the batch's device type with dtype bfloat16")


def _unflatten(flat: torch.Tensor, params: list[str], order: list[str], shapes: dict) -> torch.Tensor:
    """A bucket's flat values (in its parameters' order) as one flat tensor in the model's parameter order."""
    parts, offset = {}, 0
    for name in params:
        n = shapes[name].numel()
        parts[name] = flat[offset:offset + n]
        offset += n
    return torch.cat([parts[n] for n in order]) if set(parts) == set(order) else flat


def _scaled(values: torch.Tensor, target: torch.Tensor, bound: torch.Tensor) -> float | None:
    """The factor a with values = a x target within ``bound`` (elementwise), or None."""
    a = float(values @ target / (target @ target).clamp_min(1e-30))
    return a if bool(((values - a * target).abs() <= a * bound + 1e-7).all()) else None


def _per_micro_step_clip(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """What a rank that clips after every micro-step's backward sends to the all-reduce: its accumulation,
    clipped after each of the first k - 1 backward passes, plus the last micro-batch's gradient."""
    acc = torch.zeros_like(grads[0])
    for g in grads[:-1]:
        acc = acc + g
        acc = acc * clip_factor(float(acc.norm()), max_norm)
    return acc + grads[-1]


def check_clip(amp_clip_grads, *, world_size=2, k=4, size=3, steps=2, lr=0.1, max_norm=0.5, seed=0):
    """The gradients the optimizer used are the all-reduced gradient (what DDP's all-reduce returned) times
    min(1, max_norm / (its norm + 1e-6)), on every rank (1e-4 relative: float32); what each rank sent to
    that all-reduce is its own unclipped accumulated gradient, a multiple of the sum of its micro-batches'
    gradients within bf16 rounding (4 x 2**-8 x their sum of absolute values); the ranks end bitwise equal, with
    the weights of one process's clipped steps on the global batch within :func:`weight_tolerance`."""
    check = "check_clip"
    job = _job(check, amp_clip_grads, world_size, k, size, steps, lr, max_norm, seed)
    obs, seeds = [o["clipped"] for o in job], _data_seeds(job)
    where = f"{world_size} ranks, {k} micro-batches per step, max_norm={max_norm:g}"
    cast = _cast(obs)
    if cast:
        raise CheckFailed(check, f"the weights were cast to bfloat16, and DDP's all-reduce then stopped ({where})",
                          ranks=cast, expected="float32 parameters, DDP's all-reduce in every step", hint=_CAST)
    model = make_net(0)
    order = [n for n, _ in model.named_parameters()]
    shapes = dict(model.named_parameters())
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
            inputs[rank] = c["start"], amp_batches(seeds[rank], rank, call, k, size)
        try:
            _judge_sent(check, obs, call, _local(inputs, k, True), order, shapes, max_norm, where)
        except CheckFailed as with_bf16:
            # where the clip is concerned, a forward without autocast is as right as one with it (the dtype is
            # check_amp_step's): float32 gradients can stray from the bf16 ones by more than bf16's bound
            try:
                _judge_sent(check, obs, call, _local(inputs, k, False), order, shapes, max_norm, where)
            except CheckFailed:
                raise with_bf16 from None
    _judge_early(check, obs, where)
    _judge_unscaled(check, [o["free"] for o in job], obs, order, shapes, max_norm, where)
    for call in range(steps):
        _judge_clipped(check, obs, call, order, shapes, max_norm, where)
    states = [o["state"] for o in obs]
    differ = [r for r in range(1, world_size) if any(not torch.equal(states[0][n], states[r][n]) for n in states[0])]
    if differ:
        raise CheckFailed(check, f"the ranks end with different weights ({where})", ranks=differ,
                          expected="bitwise the same weights on every rank: the same clip factor everywhere",
                          hint="clip after DDP's all-reduce, on every rank, with the norm of the synced gradients")
    reference, scale = amp_reference(world_size, k, size, steps, lr, max_norm, seed, seeds)
    tol = weight_tolerance(lr, scale)
    diff = max((states[0][n].float() - reference[n]).abs().max().item() for n in reference)
    if diff > tol:  # the gradients were clipped right, yet the weights are not the clipped steps'
        raise CheckFailed(check, f"the weights differ from one process's clipped steps by more than bf16 rounding "
                          f"explains ({where})", ranks=range(world_size),
                          expected=f"within {tol:.2g} of the reference (lr x 8 x 2**-8 x the clipped gradients' size)",
                          got=f"max difference {diff:.3g}",
                          hint="clip once, after the last backward, and leave the clipped gradients in .grad for "
                          "the given step")
    passed(check)


def _local(inputs: dict, k: int, bf16: bool) -> dict:
    """rank -> the micro-batches' gradients at the call's weights (flat), from ``inputs``: rank -> (weights, batches);
    the forward under bf16 autocast or in float32."""
    return {rank: micro_grads(start, batches, k, bf16=bf16) for rank, (start, batches) in inputs.items()}


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


def _judge_sent(check, obs, call, local, order, shapes, max_norm, where):
    """DDP's all-reduce returned a multiple of the mean of every rank's unclipped micro-batch gradients (however
    often it synced); if not, what each rank sent says who scaled its gradients, and when."""
    world_size = len(obs)
    every = [g for rank in range(world_size) for g in local[rank]]
    bound = 4 * BF16_U * torch.stack([g.abs() for g in every]).sum(0) / world_size
    record = obs[0]["calls"][call]["synced"][-1]
    reduced = _unflatten(record["reduced"], record["params"], order, shapes)
    if _scaled(reduced, torch.stack(every).sum(0) / world_size, bound) is not None:
        return
    problem = f"DDP's all-reduce did not average the ranks' unclipped gradients: they were scaled before it ({where})"
    hint = ("clip once per optimizer step, after the last micro-batch's backward, when DDP's all-reduce has made the "
            "gradients global")
    ranks = list(range(world_size))
    for rank, o in enumerate(obs):
        records = o["calls"][call]["synced"]
        if len(records) != 1:
            continue  # synced more than once (check_amp_sync's business): what it sent is not its own accumulation
        sent = _unflatten(records[0]["sent"], records[0]["params"], order, shapes)
        grads = local[rank]
        mine = 4 * BF16_U * torch.stack([g.abs() for g in grads]).sum(0)
        if _scaled(sent, torch.stack(grads).sum(0), mine) is not None:
            continue
        ranks = [rank]
        if _scaled(sent, _per_micro_step_clip(grads, max_norm), mine) is not None:
            problem = f"the gradients were clipped at every micro-step, before DDP's all-reduce ({where})"
            hint = (f"clip once per optimizer step, after the last of the {len(grads)} backward passes: a clip inside "
                    "the micro-steps scales part of the accumulation by this rank's own factor")
        else:
            problem = f"each rank clipped its own gradients before DDP's all-reduce ({where})"
            hint = ("clip after the last micro-batch's backward, when DDP's all-reduce has made the gradients global: "
                    "inside no_sync() the gradients (and their norm) are this rank's only, so every rank scales by "
                    "its own factor and their average is not the clipped global gradient")
        break
    raise CheckFailed(check, problem, ranks=ranks, expected=f"in call {call + 1}, DDP's all-reduce carries each "
                      "rank's unclipped accumulated gradient (the sum of its micro-batches' gradients)",
                      got="it carried other values: the accumulation was scaled before the all-reduce", hint=hint)


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
        plain = _unflatten(before[0]["sent"], before[0]["params"], order, shapes)
        sent = _unflatten(after[0]["sent"], after[0]["params"], order, shapes)
        if plain.shape == sent.shape and bool(((sent - plain).abs() <= FP32_REL * plain.abs().max() + 1e-7).all()):
            continue
        ratio = float(sent @ plain / (plain @ plain).clamp_min(1e-30))
        raise CheckFailed(check, f"each rank scaled its gradients before DDP's all-reduce ({where})", ranks=[rank],
                          expected=f"in call 1, what rank {rank} sends to DDP's all-reduce with max_norm={max_norm:g} is "
                          "what it sends when no gradient reaches max_norm (the same weights and micro-batches): its "
                          "unclipped accumulated gradient", got=f"{ratio:.4g} x that",
                          hint="clip after the last micro-batch's backward, with the norm of the all-reduced gradients "
                          "(clip_grad_norm_ does it): a clip factor worked out before the all-reduce (from this rank's "
                          "own gradients, or from the other ranks' data recomputed here) is not the synced gradient's")


def _judge_clipped(check, obs, call, order, shapes, max_norm, where):
    """The step used c x the all-reduced gradient, c = min(1, max_norm / (its norm + eps)), on every rank."""
    factors = []
    for rank, o in enumerate(obs):
        c = o["calls"][call]
        record = c["synced"][-1]
        synced = _unflatten(record["reduced"], record["params"], order, shapes)
        used = c["at_step"][0]["grads"]
        used = torch.cat([(torch.zeros_like(shapes[n]) if used[n] is None else used[n]).reshape(-1) for n in order])
        norm = float(synced.norm())
        want = clip_factor(norm, max_norm)
        applied = float(used @ synced / (synced @ synced).clamp_min(1e-30))
        factors.append(applied)
        if ((used - want * synced).abs() <= FP32_REL * synced.abs().max() + 1e-7).all():
            continue
        if abs(applied - 1) <= FP32_REL and norm > max_norm:
            problem = f"the gradients the optimizer used were not clipped after DDP's all-reduce ({where})"
            hint = ("after the last backward (outside no_sync()), clip the synced gradients: "
                    "torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm) returns their global norm")
        else:
            problem = f"the clip factor is not the one of the all-reduced gradient's norm ({where})"
            hint = ("compute the norm after DDP's all-reduce, from the synced gradients of every parameter (the same "
                    "on every rank): a norm taken earlier, or of this rank's own gradients, gives each rank its own "
                    "factor (clip_grad_norm_ after the last backward does it right)")
            world_size, k = len(obs), c["forwards"]
            for times, named, why in (
                    (world_size ** 0.5, "the synced gradients' norm summed over the ranks once more",
                     f"after DDP's all-reduce every rank holds the same gradients, so summing their squares over the "
                     f"ranks counts them {world_size} times: the local norm of the synced gradients is the global one"),
                    (k, f"{k} x the gradient", f"the micro-batches' losses were summed and clipped, then divided by {k}:"
                     " scale the loss (or the gradients) first, then clip")):
                if times > 1 and abs(applied - clip_factor(norm * times, max_norm)) <= 1e-3 * max(applied, 1e-12):
                    problem, hint = f"the clip factor is that of {named} ({where})", why
                    break
        raise CheckFailed(check, problem, ranks=[rank],
                          expected=f"in call {call + 1}, the all-reduced gradient (norm {norm:.4g}) times "
                          f"min(1, {max_norm:g} / norm) = {want:.4g}",
                          got=f"the optimizer stepped with {applied:.4g} x the all-reduced gradient" if
                          ((used - applied * synced).abs() <= FP32_REL * synced.abs().max() + 1e-7).all() else
                          "the optimizer stepped with gradients that are no multiple of the all-reduced ones", hint=hint)


def check_amp_sync(amp_clip_grads, *, world_size=2, k=4, size=3, steps=2, lr=0.1, max_norm=0.5, seed=0):
    """Each call all-reduces the gradients once, in the backward of the last micro-batch (torch's flight
    recorder counts the gradient-sized all-reduces the process group ran; DDP's hook says in which
    backward), and runs no other collective carrying more than a scalar (a loss or a norm may be shared)."""
    check = "check_amp_sync"
    job = _job(check, amp_clip_grads, world_size, k, size, steps, lr, max_norm, seed)
    where = f"{world_size} ranks, {k} micro-batches per step"
    cast = _cast([o["clipped"] for o in job])
    for phase in ("clipped", "free"):
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
                    hint = (f"run the first {k - 1} micro-batches (forward and backward) inside `with "
                            "ddp_model.no_sync():` and only the last outside it")
                elif count == 0 or not at:
                    problem = f"DDP never all-reduced the gradients in one call ({where})"
                    hint = ("the last micro-batch's forward and backward must run outside no_sync(): DDP decides in "
                            "the forward whether the next backward syncs; syncing by hand skips DDP's bucketed all-reduce")
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
