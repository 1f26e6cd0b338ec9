"""What the mixed-precision checks of exercise 2's practice notebook run and compare with
(:mod:`graders.ddp_in_practice.precision`): the data, the harness that runs on the ranks, and the single-process
references (the global batch under float16 autocast, float32 master weights, the loss scaled by a power of two).

The harness acts with torch's own functions (:data:`course.checks.REAL`, taken before the student's
code runs) and builds every observer itself: a forward pre-hook counts forwards, forward hooks on the
linear layers record the dtype autocast computed them in, the DDP communication hook records what each
rank sent and what the all-reduce returned, the optimizer's step pre-hook records the gradients the step
used (with a GradScaler it fires only for a step that is not skipped); torch's flight recorder counts the
collectives the process group really ran. The grader makes the GradScaler and takes the step with it.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from graders.common.ddp_model import make_net
from graders.ddp_in_practice.harness import _wrap

_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)
FREE = 1e6  # a max_norm no gradient of these models reaches: clipping is a no-op (the weights phases)
EPS = 1e-6  # clip_grad_norm_'s: the factor is max_norm / (norm + 1e-6)
INIT_SCALE = 2.0**10  # the GradScaler's first scale: these gradients x 2**10 fit float16 (max 65504)
SHRINK = 1e-5  # the scaling phase's output layer, this much smaller: the first layer's gradients underflow in fp16
OVERFLOW = 1e5  # the scaling phase's call 1: one micro-batch of the last rank, x this (> 65504 in float16: inf)
SCALING_LR = 10.0  # the scaling phase's learning rate: its first layer's ~1e-6 gradients move the weights visibly
PHASES = ("free", "scaling", "clipped")
#: the rounding what the ranks sent is judged with: bf16's (2**-8), the coarser 16-bit type (any forward dtype
#: passes check_clip, whose business is the clip)
SENT_U = 2.0**-8
#: relative agreement of float32 computations of one value in another order (a clip factor, a scaled gradient)
FP32_REL = 1e-4
_SENDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather")


def amp_batches(seed: int, rank: int, step: int, k: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s k micro-batches of call ``step``; in a job ``seed`` is the rank's own data seed, drawn by that
    rank from os.urandom (:func:`amp_harness`), which no other rank knows. The targets grow with the rank, so the
    ranks' own gradient norms differ (by 2-4x): clipping each rank to its own norm scales them by different factors,
    which an all-reduce cannot undo; and every micro-step's local norm is above the checks' max_norm."""
    gen = torch.Generator().manual_seed(30_000 + 1000 * seed + 100 * rank + step)
    scale = 1.0 + 1.5 * rank
    return [(torch.randn(size, 4, generator=gen), scale * (torch.randn(size, 2, generator=gen) + 1)) for _ in range(k)]


def phase_batches(phase: str, seed: int, rank: int, world_size: int, step: int, k: int, size: int) -> list:
    """The micro-batches of a phase's call: :func:`amp_batches`, but in the scaling phase's first call the last rank's
    first micro-batch has inputs too large for float16 (its forward overflows: inf, then NaN gradients)."""
    batches = amp_batches(seed + {"free": 0, "scaling": 7, "clipped": 0}[phase], rank, step, k, size)
    if phase == "scaling" and step == 0 and rank == world_size - 1:
        batches[0] = (batches[0][0] * OVERFLOW, batches[0][1])
    return batches


def phase_net(phase: str, seed: int) -> nn.Sequential:
    """make_net's model; in the scaling phase its output layer's weights SHRINK x smaller, so that the gradient
    flowing back to the first layer is ~1e-6: in float16 without loss scaling it is subnormal or zero."""
    model = make_net(seed)
    if phase == "scaling":
        with torch.no_grad():
            model[2].weight.mul_(SHRINK)
    return model


def micro_grads(state: dict, batches: list, k: int, dtype=torch.float16, scale: float = INIT_SCALE,
                divide_after: bool = False) -> list:
    """Each micro-batch's gradient (flat, parameter order) of its loss / k at the weights ``state``, with the
    forward under autocast in ``dtype`` (None: float32), float32 weights, the loss times ``scale`` and the gradient
    divided by it (a power of two: exact, but for what underflows or overflows): what one rank's backward adds to
    ``.grad``, unscaled. ``divide_after``: the loss's backward first, its gradient divided by k after (in float16 the
    backward then rounds other values)."""
    model = make_net(0)
    model.load_state_dict(state)
    found = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
            out = model(x)
        (F.mse_loss(out.float(), y) / (1 if divide_after else k) * scale).backward()
        found.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]) / scale
                     / (k if divide_after else 1))
    return found


def clip_factor(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + EPS))


def one_step(state: dict, per_rank: list, lr: float, max_norm: float, scale: float):
    """One process, one SGD step from the weights ``state`` on the global batch (every rank's k micro-batches of
    ``per_rank``), forward under float16 autocast, float32 master weights, the loss times ``scale``, the gradient
    divided by it and clipped to ``max_norm``.

    Returns (state, size): ``size`` per parameter, clip factor x the largest element of the mean absolute
    micro-batch gradient (mean over (rank, micro-batch) of |g| of one micro-batch's mean loss): what bounds the
    float16 rounding of the step (:func:`graders.ddp_in_practice.precision.weight_tolerance`)."""
    model = make_net(0)
    model.load_state_dict(state)
    k = len(per_rank[0])
    grads = [g for batches in per_rank for g in micro_grads(state, batches, k, scale=scale)]
    mean_abs = torch.stack([g.abs() * k for g in grads]).mean(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.cat([x for batches in per_rank for x, _ in batches])
    y = torch.cat([y for batches in per_rank for _, y in batches])
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    (F.mse_loss(out.float(), y) * scale).backward()
    for p in model.parameters():
        p.grad.div_(scale)
    factor = clip_factor(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)), max_norm)
    optimizer.step()
    size, offset = {}, 0
    for n, p in model.named_parameters():
        size[n] = factor * float(mean_abs[offset:offset + p.numel()].max())
        offset += p.numel()
    return model.state_dict(), size


def _amp_phase(rank, amp_clip_grads, dev, phase, k, size, steps, lr, max_norm, seed, data_seed, _real=_REAL):
    """``steps`` calls of the student's amp_clip_grads on a fresh DDP model and a fresh GradScaler, each followed by
    the given code: scaler.step(optimizer), scaler.update(), optimizer.zero_grad(); what each call did. ``_real``:
    bound at import, before any student object is unpickled (a module global read here could have been replaced by
    then, or by an earlier phase's calls)."""
    real = _real
    world_size = real.get_world_size()
    model = phase_net(phase, seed + 17 * rank).to(dev)  # different on purpose: DDP starts every rank from rank 0's
    ddp_model = _wrap(model, dev)
    names = {id(p): n for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    forwards, linear_dtypes, synced, at_step = [0], [], [], []

    def on_forward(module, args):
        forwards[0] += 1

    def on_linear(module, args, output):
        linear_dtypes.append(str(output.dtype).replace("torch.", ""))

    def average(state, bucket):
        """DDP's default (average over the ranks, torch's own all_reduce), recording what this rank sent
        and what came back, in which backward."""
        buffer = bucket.buffer()
        record = {"at": forwards[0], "dtype": str(buffer.dtype).replace("torch.", ""),
                  "params": [names.get(id(p), "?") for p in bucket.parameters()],
                  "sent": buffer.detach().to("cpu", torch.float32).clone()}
        synced.append(record)

        def done(fut):
            value = fut.value()[0]
            record["reduced"] = value.detach().to("cpu", torch.float32).clone()
            return value

        return real.all_reduce(buffer.div_(world_size), async_op=True).get_future().then(done)

    def on_step(optimizer, args, kwargs):
        at_step.append({"grads": {n: None if p.grad is None else p.grad.detach().to("cpu", torch.float32).clone()
                                  for n, p in model.named_parameters()},
                        "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})})

    model.register_forward_pre_hook(checks.grader_hook(on_forward))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(checks.grader_hook(on_linear))
    ddp_model.register_comm_hook(None, average)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SCALING_LR if phase == "scaling" else lr)
    optimizer.register_step_pre_hook(on_step)

    def new_scaler(scale):
        made = torch.amp.GradScaler(dev.type, init_scale=scale, growth_interval=1_000_000)
        made.scale(torch.ones((), device=dev))  # its scale made now (the first scale() would): get_scale() works
        return made

    scaler = new_scaler(INIT_SCALE)

    def issued():
        try:
            return real.collectives()
        except RuntimeError:  # no flight recorder in this torch
            return None

    calls = []
    for step in range(steps):
        batches = phase_batches(phase, data_seed, rank, world_size, step, k, size)
        batches = [(x.to(dev), y.to(dev)) for x, y in batches]
        forwards[0] = 0
        for record in (linear_dtypes, synced, at_step):
            record.clear()
        start = checks.to_cpu({n: t.float() for n, t in model.state_dict().items()})
        scale = float(scaler.get_scale())
        before = issued()
        amp_clip_grads(ddp_model, optimizer, scaler, batches, max_norm)
        after = issued()
        given_error = None
        try:  # the exercise's given code
            scaler.step(optimizer)
            scaler.update()
        except Exception as error:  # noqa: BLE001 (what the given code met is the student's evidence)
            given_error = f"{type(error).__name__}: {error}"
            scaler = new_scaler(scale)  # a scaler left mid-step cannot go on: a fresh one at the same scale
        optimizer.zero_grad()
        grad_reduces, others, early = None, None, None
        if before is not None and after is not None:
            last = max([e["seq"] or 0 for e in before], default=0)
            new = [e for e in after if (e["seq"] or 0) > last]
            sizes = [sum(math.prod(s) for s in e["sizes"] or []) for e in new]
            grad_reduces = sum(1 for e, n in zip(new, sizes) if e["op"] == "all_reduce" and n == numel)
            # what every rank sends (DDP's own rebuild of its buckets after the first step broadcasts their sizes)
            others = [(e["op"], n) for e, n in zip(new, sizes) if e["op"] in _SENDS and n > 1
                      and not (e["op"] == "all_reduce" and n == numel)]
            # those issued before the first gradient all-reduce: what could have fed a clip factor worked out before it
            first = next((i for i, (e, n) in enumerate(zip(new, sizes)) if e["op"] == "all_reduce" and n == numel),
                         0)  # no gradient all-reduce at all: check_amp_sync's business
            early = [(e["op"], n) for e, n in zip(new[:first], sizes[:first]) if e["op"] in _SENDS and n > 1]
        calls.append({"start": start, "scale": scale, "forwards": forwards[0],
                      "linear_dtypes": sorted(set(linear_dtypes)), "synced": [dict(s) for s in synced],
                      "at_step": list(at_step), "grad_reduces": grad_reduces, "others": others, "early": early,
                      "given_error": given_error,
                      "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})})
    state = checks.to_cpu({n: t.float() for n, t in model.state_dict().items()})
    return {"state": state, "calls": calls, "order": [n for n, _ in model.named_parameters()]}


def amp_harness(rank, amp_clip_grads, k, size, lr, max_norm, seed, _urandom=os.urandom):
    """Three phases on one job, each with a fresh model, optimizer and GradScaler: ``free`` (2 calls, a max_norm no
    gradient reaches: the weights against the reference without clipping), ``scaling`` (2 calls on a model whose
    first layer's gradients underflow in float16 unless the loss is scaled; in the first call one rank's micro-batch
    overflows float16, so every rank must skip that step and halve the scale) and ``clipped`` (2 calls,
    ``max_norm``: what was clipped, when, with which norm).

    Each rank's micro-batches come from a data seed it draws from os.urandom (returned to the grader, which
    recomputes every reference from them): no rank can recompute another's data, so a clip factor worked out
    before DDP's all-reduce, without communicating, is another factor than the all-reduced gradient's, and the
    clipped weights show it, whatever the records say."""
    dev = checks.join_job()
    data_seed = int.from_bytes(_urandom(4), "little")
    found = {"data_seed": data_seed}
    for phase, steps, norm in (("free", 2, FREE), ("scaling", 2, FREE), ("clipped", 2, max_norm)):
        found[phase] = _amp_phase(rank, amp_clip_grads, dev, phase, k, size, steps, lr, norm, seed, data_seed)
    return found


# --- the arithmetic of the evidence (:mod:`graders.ddp_in_practice.precision`) ---------------------------------


def residual(values: torch.Tensor, target: torch.Tensor) -> float:
    """How far ``values`` is from the nearest multiple of ``target`` (a loss weighted otherwise is a multiple)."""
    a = float(values @ target / (target @ target).clamp_min(1e-30))
    return float((values - a * target).norm())


def unflatten(flat: torch.Tensor, params: list[str], order: list[str], shapes: dict) -> torch.Tensor:
    """A bucket's flat values (in its parameters' order) as one flat tensor in the model's parameter order."""
    parts, offset = {}, 0
    for name in params:
        n = shapes[name].numel()
        parts[name] = flat[offset:offset + n]
        offset += n
    return torch.cat([parts[n] for n in order]) if set(parts) == set(order) else flat


def multiple(values: torch.Tensor, target: torch.Tensor, bound: torch.Tensor) -> float | None:
    """The factor a with values = a x target within ``bound`` (elementwise, relative to a), or None."""
    a = float(values @ target / (target @ target).clamp_min(1e-30))
    return a if bool(((values - a * target).abs() <= a * bound + 1e-7).all()) else None


def per_micro_step_clip(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """What a rank that clips after every micro-step's backward sends to the all-reduce: its accumulation,
    clipped after each of the first k - 1 backward passes, plus the last micro-batch's gradient."""
    acc = torch.zeros_like(grads[0])
    for g in grads[:-1]:
        acc = acc + g
        acc = acc * clip_factor(float(acc.norm()), max_norm)
    return acc + grads[-1]


def weights_of(values: torch.Tensor, grads: list[torch.Tensor]) -> tuple[list[float], float]:
    """The least-squares weights w with values ~ sum_i w_i x grads[i] (each micro-batch's gradient), and the
    relative residual |values - that| / |values|: how a rank weighted its micro-batches."""
    columns = torch.stack(grads, 1).double()
    w = torch.linalg.lstsq(columns, values.double().unsqueeze(1)).solution.squeeze(1)
    rest = float((values.double() - columns @ w).norm() / values.double().norm().clamp_min(1e-30))
    return w.tolist(), rest


def flat_grads(grads: dict, order: list[str], shapes: dict) -> torch.Tensor:
    """Gradients by parameter name (None: no gradient, zeros) as one flat tensor in the model's parameter order."""
    return torch.cat([(torch.zeros_like(shapes[n]) if grads[n] is None else grads[n]).reshape(-1) for n in order])


def unscaled_twice(calls: list, per_rank: list, lr: float) -> bool:
    """Whether the first of ``calls`` (not clipped) stepped by the right step / the loss scale, judged on the weights
    (the records of the step are in the student's reach): a loss not scaled, or gradients unscaled in amp_clip_grads
    and again by the given scaler.step."""
    start, after, scale = calls[0]["start"], calls[1]["start"], calls[0]["scale"]
    reference = one_step(start, per_rank, lr, FREE, scale)[0]
    moved, right = (torch.cat([(s[n] - start[n]).reshape(-1) for n in start]) for s in (after, reference))
    return abs(float(moved @ right / (right @ right).clamp_min(1e-30)) * scale - 1) < 0.05


def carried_scale(c: dict, per_rank: list, k: int) -> float:
    """The multiple of the call's true (unscaled) mean gradient that DDP's all-reduce returned (nan if none)."""
    shapes = dict(make_net(0).named_parameters())
    if not c["synced"] or "reduced" not in c["synced"][-1]:
        return float("nan")
    reduced = unflatten(c["synced"][-1]["reduced"], c["synced"][-1]["params"], list(shapes), shapes)
    true = sum(g for batches in per_rank for g in micro_grads(c["start"], batches, k)) / len(per_rank)
    return float(reduced @ true / (true @ true).clamp_min(1e-30))


def local_grads(inputs: dict, k: int, dtype) -> dict:
    """rank -> the micro-batches' (unscaled) gradients at the call's weights (flat), from ``inputs``: rank -> (weights,
    batches); the forward under autocast in ``dtype`` or (None) in float32."""
    return {rank: micro_grads(start, batches, k, dtype=dtype) for rank, (start, batches) in inputs.items()}
