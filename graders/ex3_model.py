"""What exercise 3's checks run and compare with, apart from their verdicts (:mod:`graders.ex3`): the models,
each rank's data, the harnesses that run on the ranks, and the single-process references (BatchNorm and
Adam on the global batch).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks

PG_TIMEOUT = timedelta(seconds=15)  # a skipped collective fails in 15 s, not 30 min

# BatchNorm: initial state the harness gives every layer (same on all ranks)
C = 3
EPS = 1e-5
MOMENTUM = 0.3
WEIGHT = [1.5, 0.5, 2.0]
BIAS = [0.1, -0.2, 0.3]
RUNNING_MEAN = [0.5, -1.0, 2.0]
RUNNING_VAR = [2.0, 0.5, 1.5]
BN_STEPS = 2  # training forwards per case: the second shows how running statistics accumulate

# ZeRO
ZERO_LR = 0.01
ZERO_STEPS = 3


def _init_pg() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)


def _bn_input(rank: int, sizes, tail, step: int, offset: float = 0.0) -> torch.Tensor:
    """Rank ``rank``'s float32 input: its own mean and spread, plus a common ``offset`` (a large offset is
    where E[x^2] - E[x]^2 cancels in float32)."""
    g = torch.Generator().manual_seed(100 * step + rank + 7)
    x = torch.randn((sizes[rank], C, *tail), generator=g)
    return x * (1.0 + rank) + 2.0 * rank - step + offset


def _bn_coef(rank: int, sizes, tail, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank + 1000)
    return torch.randn((sizes[rank], C, *tail), generator=g)


def _bn_harness(rank: int, bn_cls, cases) -> list[dict]:
    """Every case in one job (a job costs more than a case): a fresh layer per case."""
    _init_pg()
    return [_bn_case(rank, bn_cls, sizes, tail, offset) for sizes, tail, offset in cases]


def _bn_case(rank: int, bn_cls, sizes, tail, offset) -> dict:
    """BN_STEPS training forwards, each followed by a backward (whose error, if any, is recorded, not raised:
    the forward's observations still serve the output and running-statistics checks)."""
    bn = bn_cls(C, eps=EPS, momentum=MOMENTUM)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(WEIGHT))
        bn.bias.copy_(torch.tensor(BIAS))
        bn.running_mean.copy_(torch.tensor(RUNNING_MEAN))
        bn.running_var.copy_(torch.tensor(RUNNING_VAR))
    bn.train()
    record = []
    for step in range(BN_STEPS):
        x = _bn_input(rank, sizes, tail, step, offset).requires_grad_()
        y = bn(x)
        if not isinstance(y, torch.Tensor):
            return {"error": f"forward returned {type(y).__name__}, not a tensor"}
        obs = {"y": y.detach().clone(), "running_mean": bn.running_mean.detach().clone(),
               "running_var": bn.running_var.detach().clone()}
        if y.shape == x.shape and y.requires_grad:
            bn.zero_grad()
            try:
                (y * _bn_coef(rank, sizes, tail, step)).sum().backward()
            except RuntimeError as exc:
                obs["backward_error"] = f"{type(exc).__name__}: {exc}"
            else:
                # an empty batch's input gradient is empty: None (nothing reached it) is the same thing
                x_grad = x.grad if x.grad is not None or x.numel() else torch.zeros_like(x)
                obs.update(x_grad=_clone(x_grad), weight_grad=_clone(bn.weight.grad), bias_grad=_clone(bn.bias.grad))
        record.append(obs)
    return {"steps": record}


def _clone(t):
    return None if t is None else t.detach().clone()


@checks.reference
def _bn_reference(sizes, tail, steps: int, offset: float = 0.0) -> list[dict]:
    """nn.BatchNorm's own functional form on the global batch (all ranks' float32 inputs concatenated),
    computed in float64: the truth a float32 recipe is measured against."""
    ws = len(sizes)
    running_mean = torch.tensor(RUNNING_MEAN, dtype=torch.float64)
    running_var = torch.tensor(RUNNING_VAR, dtype=torch.float64)
    weight = torch.tensor(WEIGHT, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    out = []
    for step in range(steps):
        xs = [_bn_input(r, sizes, tail, step, offset) for r in range(ws)]
        x = torch.cat(xs).double().requires_grad_()
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, MOMENTUM, EPS)
        ys = list(y.split(list(sizes)))
        losses = [(ys[r] * _bn_coef(r, sizes, tail, step).double()).sum() for r in range(ws)]
        x_grad = torch.autograd.grad(sum(losses), x, retain_graph=True)[0]
        per_rank = [torch.autograd.grad(loss, (weight, bias), retain_graph=True) for loss in losses]
        out.append({"xs": xs, "y": [t.detach().float() for t in ys],
                    "x_grad": [g.float() for g in x_grad.split(list(sizes))],
                    "weight_grad": [g[0].float() for g in per_rank], "bias_grad": [g[1].float() for g in per_rank],
                    "running_mean": running_mean.float(), "running_var": running_var.float()})
    return out


def _channel_stats(x: torch.Tensor):
    """(count, mean, biased variance) per channel of one rank's input, in float64; mean and variance are NaN
    for an empty input, as a naive x.mean() gives."""
    dims = [0] + list(range(2, x.dim()))
    x = x.double()
    n = x.numel() // x.shape[1]
    if n == 0:
        nan = torch.full((x.shape[1],), float("nan"), dtype=torch.float64)
        return 0, nan, nan
    return n, x.mean(dims), x.var(dims, unbiased=False)


def _bn_variant(xs: list[torch.Tensor], rank: int, running: tuple, variant: str):
    """What rank ``rank`` computes with a given (right or wrong) recipe: (output, running_mean, running_var).

    variants: global (right), local (no communication), local_count (global sums / this rank's count),
    unweighted (the plain average of the ranks' means and variances, as if every count were equal),
    within_only (the count-weighted average of the ranks' variances, without the spread of their means),
    biased (biased variance in running_var), unbiased_norm (unbiased variance to normalise),
    swapped (momentum weighing the old running value instead of the new batch value).
    """
    x = xs[rank].double()
    stats = [_channel_stats(p) for p in xs]
    full = [(n, m, v) for n, m, v in stats if n > 0]
    n = sum(k for k, _, _ in full)
    mean = sum(k * m for k, m, _ in full) / n
    var = sum(k * (v + (m - mean) ** 2) for k, m, v in full) / n
    if variant == "local":
        n, mean, var = stats[rank]
    elif variant == "local_count":
        squares = sum(k * (v + m * m) for k, m, v in full)
        n = stats[rank][0] or float("nan")
        mean = mean * sum(k for k, _, _ in full) / n
        var = squares / n - mean * mean
    elif variant == "unweighted":
        mean = sum(m for _, m, _ in full) / len(full)
        var = sum(v for _, _, v in full) / len(full)
    elif variant == "within_only":
        var = sum(k * v for k, _, v in full) / n
    unbiased = var * n / (n - 1) if n > 1 else var * float("nan")
    shape = [1, C] + [1] * (x.dim() - 2)
    norm_var = unbiased if variant == "unbiased_norm" else var
    y = (x - mean.view(shape)) / torch.sqrt(norm_var.view(shape) + EPS) \
        * torch.tensor(WEIGHT, dtype=torch.float64).view(shape) + torch.tensor(BIAS, dtype=torch.float64).view(shape)
    running_mean, running_var = (t.double() for t in running)
    keep = MOMENTUM if variant == "swapped" else 1 - MOMENTUM
    new_mean = keep * running_mean + (1 - keep) * mean
    new_var = keep * running_var + (1 - keep) * (var if variant == "biased" else unbiased)
    return y.float(), new_mean.float(), new_var.float()


def _bn_sums(xs: list[torch.Tensor]):
    """The global (mean, biased variance) from float32 (sum, sum of squares, count) all-reduced: lesson 3's
    recipe, which cancels catastrophically when the mean is large against the spread."""
    dims = [0] + list(range(2, xs[0].dim()))
    total = sum(x.sum(dims) for x in xs)
    squares = sum((x * x).sum(dims) for x in xs)
    n = sum(x.numel() // x.shape[1] for x in xs)
    mean = total / n
    return mean, squares / n - mean * mean


def _zero_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))


def _zero_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(50 * step + rank)
    x = torch.randn(5, 4, generator=g) + rank
    return x, torch.cos(x.sum(dim=1, keepdim=True)) * (1 + rank)


def _zero_train(ddp_model, optimizer, rank: int) -> None:
    for step in range(ZERO_STEPS):
        x, y = _zero_batch(rank, step)
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@checks.reference
@torch.no_grad()
def _zero_reference(world_size: int):
    """Single-process Adam on the global batch: (its state_dict, final parameters)."""
    model = _zero_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=ZERO_LR)
    for step in range(ZERO_STEPS):
        batches = [_zero_batch(rank, step) for rank in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        with torch.enable_grad():
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
    return optimizer.state_dict(), [p.detach().clone() for p in model.parameters()]


def _zero_save_harness(rank: int, save_optimizer, dirs: list[str]) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_pg()
    model = _zero_model()
    ddp_model = DDP(model)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=ZERO_LR)
    _zero_train(ddp_model, optimizer, rank)
    with checks.record_writes() as writes:  # every file this rank writes, however it writes it
        save_optimizer(optimizer, rank, os.path.join(dirs[rank], "optimizer.pt"))
    return {"writes": sorted({e["path"] for e in writes})}
