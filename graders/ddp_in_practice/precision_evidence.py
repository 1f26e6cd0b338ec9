"""What part 5's checks read in the gradients themselves (:mod:`graders.ddp_in_practice.precision`): whether they
carry a float16 forward's rounding, and what each rank sent to DDP's all-reduce. Judged on the values the grader's
communication hook and step hook recorded, against gradients recomputed here."""

from __future__ import annotations

import torch

from course.checks import CheckFailed
from graders.common.ddp_model import make_net
from graders.ddp_in_practice.precision_harness import (
    FP32_REL,
    SENT_U,
    flat_grads,
    micro_grads,
    multiple,
    per_micro_step_clip,
    phase_batches,
    residual,
    unflatten,
    weights_of,
)


def _per_rank(phase, seeds, call, k, size):
    world_size = len(seeds)
    return [phase_batches(phase, seeds[rank], rank, world_size, call, k, size) for rank in range(world_size)]


def judge_fp16(check, obs, phase, k, size, seeds, where):
    """The gradients the optimizer used are no float32 forward's (to float32's precision), and not one forward's of
    each rank's micro-batches together, recomputed here at the call's weights: the effect of autocast, which the linear
    layers' recorded dtypes (in the student's reach) only report."""
    world_size = len(obs)
    shapes = dict(make_net(0).named_parameters())
    order = list(shapes)
    for call in range(len(obs[0]["calls"])):
        c = obs[0]["calls"][call]
        if not c["at_step"]:
            continue  # a skipped step: _judge_weights's business
        used = flat_grads(c["at_step"][-1]["grads"], order, shapes)
        per_rank = _per_rank(phase, seeds, call, k, size)
        fp16 = [sum(g for batches in per_rank for g in micro_grads(c["start"], batches, k, divide_after=after))
                / world_size for after in (False, True)]  # each loss divided by k before its backward, or after
        fp32 = sum(g for batches in per_rank for g in micro_grads(c["start"], batches, k, dtype=None)) / world_size
        near, far = min(residual(used, g) for g in fp16), residual(used, fp32)
        # each rank's micro-batches through the model as one batch: the same numbers but for fp16's rounding, whose
        # pattern (the rounding of that one batch's forward) tells it from the micro-batches' own
        whole = sum(micro_grads(c["start"], [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))],
                                1)[0] for batches in per_rank) / world_size
        together = residual(used, whole)
        explained = 1e-2 * float(used.norm())  # a residual this small: the gradients are that forward's
        if together < 0.5 * min(near, far) and together <= explained:
            raise CheckFailed(check, f"the micro-batches went through the model as one batch ({where})",
                              ranks=range(world_size), expected=f"in call {call + 1}, the gradients of the {k} "
                              "micro-batches' forwards, each under float16 autocast on its own (as the grader "
                              "recomputes them at the call's weights)",
                              got=f"{together:.3g} from one forward of all of them, {near:.3g} from the micro-batches' "
                              "own", hint="for each micro-batch: its forward and loss under autocast, its scaled loss "
                              "/ k backward, the first k - 1 inside no_sync(): the micro-batches are there because "
                              "the whole batch at once does not fit")
        # a float32 forward: the gradients are a float32 forward's to float32's precision (a float16 forward's differ
        # by float16's rounding, ~1e-3, however its losses were weighted, before or after the backward)
        if far <= FP32_REL * float(used.norm()) and near > far:
            raise CheckFailed(check, f"the gradients do not carry float16's rounding: the forward ran in float32 "
                              f"({where})", ranks=range(world_size), expected=f"in call {call + 1}, the gradients "
                              "of a forward under float16 autocast (as the grader recomputes them at the call's "
                              "weights)", got=f"{near:.3g} from the float16 forward's gradients, {far:.3g} from a "
                              "float32 forward's", hint="run each micro-batch's forward (the model call and the "
                              "loss) inside a torch.autocast context for the batch's device type with dtype float16")


def judge_sent(check, obs, call, local, order, shapes, max_norm, where) -> float:
    """DDP's all-reduce returned a multiple of the mean of every rank's unclipped micro-batch gradients (however
    often it synced): that multiple, the loss scale the gradients carry; if not, what each rank sent says who
    scaled its gradients, and when. The bounds use bf16's rounding (2**-8, the coarser of the 16-bit types), so
    that a forward in either type is judged on its clip alone."""
    world_size = len(obs)
    every = [g for rank in range(world_size) for g in local[rank]]
    bound = 4 * SENT_U * torch.stack([g.abs() for g in every]).sum(0) / world_size
    record = obs[0]["calls"][call]["synced"][-1]
    reduced = unflatten(record["reduced"], record["params"], order, shapes)
    found = multiple(reduced, torch.stack(every).sum(0) / world_size, bound)
    if found is not None:
        return found
    problem = f"DDP's all-reduce did not average the ranks' unclipped gradients: they were scaled before it ({where})"
    hint = ("clip once per optimizer step, after the last micro-batch's backward, when DDP's all-reduce has made the "
            "gradients global")
    ranks, factors = list(range(world_size)), []
    for rank, o in enumerate(obs):
        records, scale = o["calls"][call]["synced"], o["calls"][call]["scale"]
        if len(records) != 1:
            continue  # synced more than once (check_amp_sync's business): what it sent is not its own accumulation
        sent = unflatten(records[0]["sent"], records[0]["params"], order, shapes)
        grads = local[rank]
        mine = 4 * SENT_U * torch.stack([g.abs() for g in grads]).sum(0)
        factor = multiple(sent, torch.stack(grads).sum(0), mine)
        if factor is not None:
            factors.append(f"rank {rank} {factor:.4g} x")
            continue
        if not sent.isfinite().all():
            problem, ranks, got = f"the gradients overflowed float16 before DDP's all-reduce ({where})", [rank], \
                f"rank {rank} sent inf or NaN in call {call + 1}, whose data overflow nowhere"
            hint = "scale each loss with the given scaler (its scale is a power of two these gradients fit)"
            break
        ranks, (w, rest) = [rank], weights_of(sent, grads)
        got = f"rank {rank} sent " + (" + ".join(f"{a:.4g} x g{i + 1}" for i, a in enumerate(w)) + " (g: its micro-"
                                      "batches' true gradients)" if rest < 1e-2 else "no multiple of its gradients")
        if any(multiple(sent, per_micro_step_clip([g * s for g in grads], max_norm), mine) is not None
               for s in (scale, 1.0)):
            problem = f"the gradients were clipped at every micro-step, before DDP's all-reduce ({where})"
            hint = (f"clip once per optimizer step, after the last of the {len(grads)} backward passes: a clip inside "
                    "the micro-steps scales part of the accumulation by this rank's own factor")
        elif rest < 1e-2 and abs(w[-1] - scale * w[0]) < 0.02 * abs(w[-1]) and max(w[:-1]) - min(w[:-1]) < 0.02 * w[0]:
            problem = (f"the micro-batches' gradients reached DDP's all-reduce at different scales: 1 to "
                       f"{len(grads) - 1} unscaled, the last one {w[-1] / w[0]:.4g} x ({where})")
            hint = ("scale every micro-batch's loss with the given scaler, and unscale only after the last backward: "
                    "DDP's all-reduce adds the last micro-batch's gradients to what .grad holds")
        elif rest < 1e-2 and min(abs(a) for a in w) <= 1e-4 * max(abs(a) for a in w):
            kept = [i + 1 for i, a in enumerate(w) if abs(a) > 1e-4 * max(abs(b) for b in w)]
            problem = (f"DDP's all-reduce carried micro-batch{'es' if len(kept) > 1 else ''} "
                       f"{', '.join(map(str, kept))} of {len(grads)} only: the others' gradients never reached it "
                       f"({where})")
            hint = ("every micro-batch's backward adds to .grad, and DDP's all-reduce in the backward of the LAST one "
                    "(the first ones inside no_sync()) carries the sum: zero the gradients only after the step (the "
                    "given code does)")
        else:
            problem = f"each rank clipped its own gradients before DDP's all-reduce ({where})"
            hint = ("clip after the last micro-batch's backward, when DDP's all-reduce has made the gradients global: "
                    "inside no_sync() (or at every micro-step) the gradients (and their norm) are this rank's only, "
                    "so every rank scales by its own factor and their average is not the clipped global gradient")
        break
    else:
        got = f"each rank its own multiple of its accumulated gradient: {', '.join(factors)}"
    raise CheckFailed(check, problem, ranks=ranks, expected=f"in call {call + 1}, DDP's all-reduce carries each "
                      "rank's unclipped accumulated gradient (the sum of its micro-batches' gradients), all alike "
                      "scaled", got=got, hint=hint)
