"""What the mixed-precision checks of exercise 2's practice notebook run and compare with
(:mod:`graders.ddp_in_practice.precision`): the data, the harness that runs on the ranks, and the single-process
references (the global batch under bf16 autocast, float32 master weights).

The harness acts with torch's own functions (:data:`course.checks.REAL`, taken before the student's
code runs) and builds every observer itself: a forward pre-hook counts forwards, forward hooks on the
linear layers record the dtype autocast computed them in, the DDP communication hook records what each
rank sent and what the all-reduce returned, the optimizer's step pre-hook records the gradients the step
used; torch's flight recorder counts the collectives the process group really ran.
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
FREE = 1e6  # a max_norm no gradient of these models reaches: clipping is a no-op (the weights phase)
EPS = 1e-6  # clip_grad_norm_'s: the factor is max_norm / (norm + 1e-6)
_SENDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather")


def amp_batches(seed: int, rank: int, step: int, k: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s k micro-batches of call ``step``; in a job ``seed`` is the rank's own data seed, drawn by that
    rank from os.urandom (:func:`amp_harness`), which no other rank knows. The targets grow with the rank, so the ranks' own
    gradient norms differ (by 2-4x): clipping each rank to its own norm scales them by different factors,
    which an all-reduce cannot undo; and every micro-step's local norm is above the checks' max_norm."""
    gen = torch.Generator().manual_seed(30_000 + 1000 * seed + 100 * rank + step)
    scale = 1.0 + 1.5 * rank
    return [(torch.randn(size, 4, generator=gen), scale * (torch.randn(size, 2, generator=gen) + 1)) for _ in range(k)]


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


def micro_grads(state: dict, batches: list, k: int, bf16: bool = True) -> list[torch.Tensor]:
    """Each micro-batch's gradient (flat, parameter order) of its loss / k at the weights ``state``, with the
    forward under bf16 autocast (or, ``bf16=False``, in float32) and float32 weights: what one rank's backward
    adds to ``.grad``."""
    model = make_net(0)
    model.load_state_dict(state)
    found = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        (F.mse_loss(out.float(), y) / k).backward()
        found.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]))
    return found


def clip_factor(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + EPS))


@checks.reference
def amp_reference(world_size: int, k: int, size: int, steps: int, lr: float, max_norm: float, seed: int,
                  data_seeds: tuple | None = None):
    """One process, ``steps`` SGD steps on the global batch (every rank's k micro-batches, from each rank's data seed
    in ``data_seeds``, or from ``seed`` for all), forward under bf16 autocast, float32 master weights, the gradient
    clipped to ``max_norm`` once per step.

    Returns (state, scale): ``scale`` is sum over the steps of clip factor x the largest element of the mean
    absolute micro-batch gradient, mean over (rank, micro-batch) of |g|: what bounds the bf16 rounding of
    the step (:func:`graders.ddp_in_practice.precision.weight_tolerance`)."""
    model = make_net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scale = 0.0
    for step in range(steps):
        per_rank = [amp_batches(seed if data_seeds is None else data_seeds[rank], rank, step, k, size)
                    for rank in range(world_size)]
        state = {n: t.clone() for n, t in model.state_dict().items()}
        grads = [g for batches in per_rank for g in micro_grads(state, batches, k)]
        mean_abs = torch.stack([g.abs() * k for g in grads]).mean(0)  # |g| of one micro-batch's mean loss
        optimizer.zero_grad()
        x = torch.cat([x for batches in per_rank for x, _ in batches])
        y = torch.cat([y for batches in per_rank for _, y in batches])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.mse_loss(out.float(), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scale += clip_factor(float(norm), max_norm) * float(mean_abs.max())
        optimizer.step()
    return model.state_dict(), scale


def _amp_phase(rank, amp_clip_grads, dev, k, size, steps, lr, max_norm, seed, data_seed, _real=_REAL):
    """``steps`` calls of the student's amp_clip_grads on a fresh DDP model, each followed by the given optimizer
    step (and zero_grad); what each call did. ``_real``: bound at import, before any student object is unpickled
    (a module global read here could have been replaced by then, or by the first phase's calls)."""
    real = _real
    world_size = real.get_world_size()
    model = make_net(seed + 17 * rank).to(dev)  # different on purpose: DDP starts every rank from rank 0's
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
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    optimizer.register_step_pre_hook(on_step)

    def issued():
        try:
            return real.collectives()
        except RuntimeError:  # no flight recorder in this torch
            return None

    calls = []
    for step in range(steps):
        batches = [(x.to(dev), y.to(dev)) for x, y in amp_batches(data_seed, rank, step, k, size)]
        forwards[0] = 0
        for record in (linear_dtypes, synced, at_step):
            record.clear()
        start = checks.to_cpu({n: t.float() for n, t in model.state_dict().items()})
        before = issued()
        amp_clip_grads(ddp_model, batches, max_norm)
        after = issued()
        optimizer.step()  # the exercise's given code: one step with what .grad holds, then the gradients zeroed
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
        calls.append({"start": start, "forwards": forwards[0], "linear_dtypes": sorted(set(linear_dtypes)),
                      "synced": [dict(s) for s in synced], "at_step": list(at_step), "grad_reduces": grad_reduces,
                      "others": others, "early": early,
                      "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})})
    state = checks.to_cpu(model.state_dict())
    return {"state": state, "calls": calls, "order": [n for n, _ in model.named_parameters()]}


def amp_harness(rank, amp_clip_grads, k, size, steps, lr, max_norm, seed, _urandom=os.urandom):
    """Two phases on one job: ``free`` (a max_norm no gradient reaches: the weights against the reference
    without clipping) and ``clipped`` (``max_norm``: what was clipped, when, with which norm).

    Each rank's micro-batches come from a data seed it draws from os.urandom (returned to the grader, which
    recomputes every reference from them): no rank can recompute another's data, so a clip factor worked out
    before DDP's all-reduce, without communicating, is another factor than the all-reduced gradient's, and the
    clipped weights show it, whatever the records say."""
    dev = checks.join_job()
    data_seed = int.from_bytes(_urandom(4), "little")
    return {"data_seed": data_seed,
            "free": _amp_phase(rank, amp_clip_grads, dev, k, size, steps, lr, FREE, seed, data_seed),
            "clipped": _amp_phase(rank, amp_clip_grads, dev, k, size, steps, lr, max_norm, seed, data_seed)}
