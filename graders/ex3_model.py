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


class _Block(nn.Module):
    """A residual-style block: BatchNorms nested one level down."""

    def __init__(self, bn: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.norm = bn
        self.branch = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=0.05))

    def forward(self, x):
        return self.norm(self.conv(x)) + self.branch(x)


def _convert_model(case: str) -> nn.Module:
    """The models a conversion is tried on, with non-default weights and running statistics."""
    torch.manual_seed(1)
    if case == "nested":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), _Block(nn.BatchNorm2d(4, eps=1e-3)))
    elif case == "top-level":
        model = nn.BatchNorm1d(5, momentum=0.2)
    elif case == "mixed":
        model = nn.ModuleDict({
            "stem": nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, affine=False)),
            "blocks": nn.ModuleList([
                nn.Sequential(nn.Conv3d(2, 2, 1), nn.BatchNorm3d(2, eps=1e-4)),
                nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=None))),
            ]),
        })
    else:
        raise ValueError(case)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                n = module.num_features
                module.running_mean.copy_(torch.linspace(-1, 1, n))
                module.running_var.copy_(torch.linspace(0.5, 2, n))
                module.num_batches_tracked.fill_(7)
                if module.affine:
                    module.weight.copy_(torch.linspace(0.5, 1.5, n))
                    module.bias.copy_(torch.linspace(-0.3, 0.3, n))
    return model


# torch's own classes, taken when the grader is imported (before any student code runs in a rank): a
# student's convert_model that assigns `nn.SyncBatchNorm = nn.BatchNorm2d` must not make BatchNorms look converted
_SYNC_BATCHNORM = nn.SyncBatchNorm
_BATCHNORM = nn.modules.batchnorm._BatchNorm
_IS_INSTANCE = isinstance


def _describe_modules(model: nn.Module) -> dict:
    return {
        name: {
            "cls": type(m).__name__,
            "sync": _IS_INSTANCE(m, _SYNC_BATCHNORM),
            "bn": _IS_INSTANCE(m, _BATCHNORM),
            "config": (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)
            if _IS_INSTANCE(m, _BATCHNORM) else None,
        }
        for name, m in model.named_modules()
    }


def _convert_harness(rank: int, convert_model, cases: tuple[str, ...]) -> list[dict]:
    _init_pg()
    return [_convert_case(convert_model, case) for case in cases]


def _convert_case(convert_model, case: str) -> dict:
    model = _convert_model(case)
    before = {"modules": _describe_modules(model),
              "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    converted = convert_model(model)
    if not isinstance(converted, nn.Module):
        return {"before": before, "returned": type(converted).__name__}
    return {"before": before, "returned": None, "modules": _describe_modules(converted),
            "state": {k: v.detach().clone() for k, v in converted.state_dict().items()}}


def _bn_input(rank: int, sizes, tail, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank + 7)
    x = torch.randn((sizes[rank], C, *tail), generator=g)
    return x * (1.0 + rank) + 2.0 * rank - step  # each rank's data has its own mean and spread


def _bn_coef(rank: int, sizes, tail, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank + 1000)
    return torch.randn((sizes[rank], C, *tail), generator=g)


def _bn_harness(rank: int, bn_cls, cases) -> list[dict]:
    """Every case in one job (a job costs more than a case): a fresh layer per case."""
    _init_pg()
    return [_bn_case(rank, bn_cls, sizes, tail) for sizes, tail in cases]


def _bn_case(rank: int, bn_cls, sizes, tail) -> dict:
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
        x = _bn_input(rank, sizes, tail, step).requires_grad_()
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
                obs.update(x_grad=x.grad, weight_grad=_clone(bn.weight.grad), bias_grad=_clone(bn.bias.grad))
        record.append(obs)
    return {"steps": record}


def _clone(t):
    return None if t is None else t.detach().clone()


def _bn_reference(sizes, tail, steps: int) -> list[dict]:
    """nn.BatchNorm's own functional form on the global batch (all ranks' inputs concatenated)."""
    ws = len(sizes)
    running_mean, running_var = torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR)
    weight = torch.tensor(WEIGHT, requires_grad=True)
    bias = torch.tensor(BIAS, requires_grad=True)
    out = []
    for step in range(steps):
        xs = [_bn_input(r, sizes, tail, step) for r in range(ws)]
        x = torch.cat(xs).requires_grad_()
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, MOMENTUM, EPS)
        ys = list(y.split(sizes))
        losses = [(ys[r] * _bn_coef(r, sizes, tail, step)).sum() for r in range(ws)]
        x_grad = torch.autograd.grad(sum(losses), x, retain_graph=True)[0]
        per_rank = [torch.autograd.grad(loss, (weight, bias), retain_graph=True) for loss in losses]
        out.append({"xs": xs, "y": [t.detach() for t in ys], "x_grad": list(x_grad.split(sizes)),
                    "weight_grad": [g[0] for g in per_rank], "bias_grad": [g[1] for g in per_rank],
                    "running_mean": running_mean.clone(), "running_var": running_var.clone()})
    return out


def _bn_variant(xs: list[torch.Tensor], rank: int, running: tuple, variant: str):
    """What rank ``rank`` computes with a given (right or wrong) recipe: (output, running_mean, running_var).

    variants: global (right), local (no all_reduce), local_count (global sums / local count),
    biased (biased variance in running_var), unbiased_norm (unbiased variance to normalise),
    swapped (momentum weighing the old running value instead of the new batch value).
    """
    x = xs[rank]
    dims = [0] + list(range(2, x.dim()))
    parts = [xs[rank]] if variant == "local" else xs
    total = sum(p.sum(dims) for p in parts)
    squares = sum((p * p).sum(dims) for p in parts)
    n = x.numel() / x.shape[1] if variant in ("local", "local_count") else sum(p.numel() / p.shape[1] for p in parts)
    mean = total / n
    var = squares / n - mean * mean
    unbiased = var * n / max(n - 1, 1)
    shape = [1, C] + [1] * (x.dim() - 2)
    norm_var = unbiased if variant == "unbiased_norm" else var
    y = (x - mean.view(shape)) / torch.sqrt(norm_var.view(shape) + EPS) * torch.tensor(WEIGHT).view(shape) \
        + torch.tensor(BIAS).view(shape)
    running_mean, running_var = running
    keep = MOMENTUM if variant == "swapped" else 1 - MOMENTUM
    new_mean = keep * running_mean + (1 - keep) * mean
    new_var = keep * running_var + (1 - keep) * (var if variant == "biased" else unbiased)
    return y, new_mean, new_var


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


def _zero_optimizer_harness(rank: int, make_zero_optimizer) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_pg()
    model = _zero_model()
    ddp_model = DDP(model)
    optimizer = make_zero_optimizer(ddp_model.parameters(), ZERO_LR)
    obs = {"type": type(optimizer).__name__, "zero": isinstance(optimizer, ZeroRedundancyOptimizer)}
    if not isinstance(optimizer, torch.optim.Optimizer):
        return obs
    _zero_train(ddp_model, optimizer, rank)
    local = optimizer.optim if obs["zero"] else optimizer
    obs["local_type"] = type(local).__name__
    obs["local"] = [i for i, p in enumerate(model.parameters()) if local.state.get(p)]
    obs["params"] = [p.detach().clone() for p in model.parameters()]
    if obs["zero"]:
        optimizer.consolidate_state_dict(to=0)
        obs["state_dict"] = optimizer.state_dict() if rank == 0 else None
    else:
        obs["state_dict"] = optimizer.state_dict()
    return obs


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
