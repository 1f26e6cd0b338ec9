"""Checks for exercise 3: SyncBatchNorm and sharded optimizer state (ZeRO).

Each check runs the student's function or class on real ranks (gloo, CPU)
through a harness below, which returns plain observations; the verdict is
computed here, against single-process references: BatchNorm on the global
batch, Adam on the global batch. Per-rank data differ in mean, scale and batch
size, so a missing all_reduce or a local count cannot pass by accident.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed, stranded

PG_TIMEOUT = timedelta(seconds=15)  # a skipped collective fails in 15 s, not 30 min

# BatchNorm: initial state the harness gives every layer (same on all ranks)
C = 3
EPS = 1e-5
MOMENTUM = 0.3
WEIGHT = [1.5, 0.5, 2.0]
BIAS = [0.1, -0.2, 0.3]
RUNNING_MEAN = [0.5, -1.0, 2.0]
RUNNING_VAR = [2.0, 0.5, 1.5]
BN_RTOL, BN_ATOL = 1e-4, 1e-5  # float32, variance from sums of squares
BN_STEPS = 2  # training forwards per case: the second shows how running statistics accumulate

# ZeRO
ZERO_LR = 0.01
ZERO_STEPS = 3
ZERO_ATOL = 1e-6


def _init_pg() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=BN_RTOL, atol=BN_ATOL, equal_nan=True)


# =========================================================================== converting BatchNorms


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


def _convert_verdict(check: str, obs: dict, case: str, rank: int) -> None:
    hint = "return nn.SyncBatchNorm.convert_sync_batchnorm(model): it replaces every BatchNorm, however deep"
    if obs["returned"] is not None:
        raise CheckFailed(check, f"convert_model returned {obs['returned']}, not a model ({case} model)",
                          ranks=[rank], hint="return the converted model: " + hint)
    before, after = obs["before"]["modules"], obs["modules"]
    bns = [name for name, m in before.items() if m["bn"]]
    top = "(the model itself)"
    left = [f"{name or top} ({after[name]['cls']})" for name in bns
            if name in after and not after[name]["sync"]]
    if left:
        ignored = case == "top-level"
        raise CheckFailed(
            check,
            f"{len(left)} of {len(bns)} BatchNorm layers were not converted to SyncBatchNorm in the {case} model: "
            + ", ".join(left[:4]),
            ranks=[rank],
            expected="every BatchNorm1d/2d/3d, at any depth, becomes an nn.SyncBatchNorm",
            hint=("when the model itself is a BatchNorm, convert_sync_batchnorm cannot change it in place and "
                  "returns a NEW module: return its result, not the model you passed in" if ignored else hint),
        )
    missing = [name or top for name in bns if name not in after]
    expect(not missing, check, f"the converted {case} model lost modules: {', '.join(missing[:4])}",
           ranks=[rank], hint="keep the model's structure: " + hint)
    changed = [f"{name or top}: {before[name]['config']} -> {after[name]['config']}"
               for name in bns if before[name]["config"] != after[name]["config"]]
    expect(not changed, check,
           f"converted layers changed their settings (num_features, eps, momentum, affine, track_running_stats) "
           f"in the {case} model: " + "; ".join(changed[:3]),
           ranks=[rank], hint="copy each BatchNorm's settings: " + hint)
    state_before, state_after = obs["before"]["state"], obs["state"]
    lost = [k for k in state_before
            if k not in state_after or not torch.equal(state_before[k], state_after[k])]
    expect(
        not lost, check,
        f"the converted {case} model does not keep the trained weights and running statistics: "
        + ", ".join(lost[:5]) + (" ..." if len(lost) > 5 else ""),
        ranks=[rank],
        expected="weight, bias, running_mean, running_var and num_batches_tracked carried over unchanged",
        hint="fresh SyncBatchNorm layers forget what was learned: " + hint,
    )


def _check_convert(check: str, convert_model, cases: tuple[str, ...]) -> None:
    checks.require_written(check, convert_model=convert_model)
    job = checks.run(check, _convert_harness, 2, args=(convert_model, cases))
    for rank, per_case in enumerate(job.values):
        for case, obs in zip(cases, per_case):
            _convert_verdict(check, obs, case, rank)
    passed(check)


def check_convert(convert_model) -> None:
    """Every BatchNorm of a model (nested ones too) becomes a SyncBatchNorm, keeping weights and statistics."""
    _check_convert("check_convert", convert_model, ("nested",))


def check_convert_any_batchnorm(convert_model) -> None:
    """Also a model that IS a BatchNorm, BatchNorm1d/3d, deep nesting in ModuleDict/ModuleList, affine=False."""
    _check_convert("check_convert_any_batchnorm", convert_model, ("mixed", "top-level"))


# =========================================================================== a synchronised BatchNorm on CPU

# (per-rank batch sizes, trailing dims): uneven sizes, so the count matters
_BN_CASES = {
    2: [((1, 4), (2,)), ((2, 5), ())],
    3: [((2, 5, 3), ()), ((3, 1, 2), (2, 2))],
}


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


_BN_MISTAKES = {
    "local": "the statistics of rank {rank}'s own batch only: the sums were never all-reduced across ranks",
    "local_count": "the all-reduced sums divided by rank {rank}'s own count: all-reduce the count too",
    "biased": "running_var was updated with the biased variance (divided by n): nn.BatchNorm keeps the "
              "unbiased one, var * n / (n - 1), with n the GLOBAL count",
    "unbiased_norm": "the output was normalised with the unbiased variance: normalise with the biased one "
                     "(divided by n), use the unbiased one only for running_var",
    "swapped": "momentum was applied the wrong way round: nn.BatchNorm computes "
               "running = (1 - momentum) * running + momentum * batch_statistic",
}


def _diagnose(xs, rank, running, key: str, got: torch.Tensor) -> str | None:
    index = {"y": 0, "running_mean": 1, "running_var": 2}[key]
    for variant, text in _BN_MISTAKES.items():
        if _close(got, _bn_variant(xs, rank, running, variant)[index]):
            return text.format(rank=rank)
    return None


def _run_bn(check: str, bn_cls):
    """(sizes, tail, observations per rank, reference) for every case, world sizes 2 and 3."""
    checks.require_written(check, CPUSyncBatchNorm=bn_cls)
    mistakes = [
        Mistake(lambda rank, text: "in-place operation" in text,
                "forward changed a tensor in place that autograd tracks, such as its input x (rank {rank})",
                "compute new tensors (y = (x - mean) / ...) instead of changing x or saved tensors in place"),
        Mistake(lambda rank, text: stranded(text),
                "rank {rank} lost its peers inside a collective ({ws}-rank job)",
                "every rank must call the same all_reduce(s), in the same order and with the same tensor sizes"),
    ]
    for ws, cases in _BN_CASES.items():
        job = checks.memo(check, ("bn", bn_cls, ws), lambda ws=ws, cases=cases: checks.run(
            check, _bn_harness, ws, args=(bn_cls, cases), mistakes=mistakes))
        for index, (sizes, tail) in enumerate(cases):
            values = [per_case[index] for per_case in job.values]
            for rank, obs in enumerate(values):
                if "error" in obs:
                    raise CheckFailed(check, f"rank {rank}: {obs['error']}", ranks=[rank],
                                      hint="forward must return the normalised tensor, shaped like its input")
            yield ws, sizes, tail, values, _bn_reference(sizes, tail, BN_STEPS)


def _count(sizes, tail) -> int:
    count = sum(sizes)
    for t in tail:
        count *= t
    return count


def _where(ws: int, sizes, tail) -> str:
    shape = ", ".join(["N", str(C)] + [str(t) for t in tail])
    return f"{ws} ranks, input ({shape}) with N = {list(sizes)} per rank"


def _sanity(reference: list[dict]) -> None:
    """The data must tell the right recipe from the wrong ones, or the check proves nothing."""
    for step in reference:
        xs = step["xs"]
        for rank in range(len(xs)):
            running = (torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR))
            right = _bn_variant(xs, rank, running, "global")
            for variant in _BN_MISTAKES:
                wrong = _bn_variant(xs, rank, running, variant)
                keys = {"unbiased_norm": (0,), "biased": (2,), "swapped": (1, 2)}.get(variant, (0, 1))
                if any(_close(right[i], wrong[i]) for i in keys):
                    raise AssertionError(f"grader data cannot tell {variant} from right on rank {rank}")


def check_syncbn_output(bn_cls) -> None:
    """In training mode every rank's output is normalised with the GLOBAL batch's mean and variance."""
    check = "check_syncbn_output"
    for ws, sizes, tail, values, reference in _run_bn(check, bn_cls):
        _sanity(reference)
        ref = reference[0]
        for rank, obs in enumerate(values):
            y = obs["steps"][0]["y"]
            if _close(y, ref["y"][rank]):
                continue
            running = (torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR))
            mistake = _diagnose(ref["xs"], rank, running, "y", y) if y.shape == ref["y"][rank].shape else None
            raise CheckFailed(
                check,
                f"the output differs from BatchNorm on the global batch ({_where(ws, sizes, tail)})",
                ranks=[rank],
                expected=f"y = (x - mean) / sqrt(var + eps) * weight + bias, with the mean and biased variance of "
                f"the {_count(sizes, tail)} values per channel on all ranks",
                got=(f"{mistake}" if mistake else
                     f"shape {tuple(y.shape)}, max |diff| {_maxdiff(y, ref['y'][rank])}"),
                hint="all-reduce (sum, sum of squares, count) per channel, then mean = sum / count and "
                "var = sum_sq / count - mean**2",
            )
    passed(check)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{float((a.float() - b.float()).abs().max()):.3g}" if a.shape == b.shape else "(shapes differ)"


def check_syncbn_running_stats(bn_cls) -> None:
    """running_mean/running_var follow nn.BatchNorm's update with global statistics (unbiased variance, momentum)."""
    check = "check_syncbn_running_stats"
    for ws, sizes, tail, values, reference in _run_bn(check, bn_cls):
        for step, ref in enumerate(reference):
            before = ((torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR)) if step == 0 else
                      (reference[step - 1]["running_mean"], reference[step - 1]["running_var"]))
            for rank, obs in enumerate(values):
                for key in ("running_mean", "running_var"):
                    got = obs["steps"][step][key]
                    if _close(got, ref[key]):
                        continue
                    if _close(got, before[0 if key == "running_mean" else 1]):
                        mistake = f"{key} was not updated at all"
                    else:
                        mistake = _diagnose(ref["xs"], rank, before, key, got)
                    raise CheckFailed(
                        check,
                        f"{key} after forward #{step + 1} differs from nn.BatchNorm on the global batch "
                        f"({_where(ws, sizes, tail)}, momentum {MOMENTUM})",
                        ranks=[rank],
                        expected=f"{key} = (1 - momentum) * {key} + momentum * batch_"
                        + ("mean" if key == "running_mean" else "var_unbiased")
                        + f" = {_fmt(ref[key])}",
                        got=f"{_fmt(got)}" + (f": {mistake}" if mistake else ""),
                        hint="update the buffers in place under torch.no_grad(), with the global mean and the "
                        "unbiased global variance (var * n / (n - 1)), n = the global count",
                    )
    passed(check)


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in t.flatten().tolist()[:6]) + "]"


def check_syncbn_backward(bn_cls) -> None:
    """Gradients flow through the all_reduce: input and weight gradients equal global-batch BatchNorm's."""
    check = "check_syncbn_backward"
    for ws, sizes, tail, values, reference in _run_bn(check, bn_cls):
        ref = reference[0]
        for rank, obs in enumerate(values):
            got = obs["steps"][0]
            if "backward_error" in got:
                raise CheckFailed(check, f"backward through your forward failed ({_where(ws, sizes, tail)}): "
                                  f"{got['backward_error']}", ranks=[rank],
                                  hint="build new tensors (torch.cat, arithmetic) instead of changing tensors "
                                  "that autograd saved, in place")
            if "x_grad" not in got or not _close(got["y"], ref["y"][rank]):
                raise CheckFailed(check, "the forward output is wrong, so its gradients cannot be checked "
                                  f"({_where(ws, sizes, tail)})", ranks=[rank],
                                  hint="make check_syncbn_output pass first")
            for key, name in (("x_grad", "input"), ("weight_grad", "weight"), ("bias_grad", "bias")):
                if got[key] is None or not _close(got[key], ref[key][rank]):
                    raise CheckFailed(
                        check,
                        f"the {name} gradient differs from BatchNorm on the global batch ({_where(ws, sizes, tail)})",
                        ranks=[rank],
                        expected=f"d(sum of every rank's loss)/d({name}) on this rank, within {BN_ATOL:g}",
                        got="no gradient" if got[key] is None else f"max |diff| {_maxdiff(got[key], ref[key][rank])}",
                        hint="the mean and variance depend on every rank's input, so the gradient must flow "
                        "back through the all_reduce: use torch.distributed.nn.functional.all_reduce "
                        "(differentiable; its backward all-reduces the gradients), not dist.all_reduce, and do "
                        "not detach the statistics",
                    )
    passed(check)


# =========================================================================== ZeRO: sharded optimizer state


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


def _sharding_verdict(check: str, values: list[dict], ws: int) -> None:
    hint = ("return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr): each rank then "
            "keeps Adam's state only for its own shard of the parameters")
    plain = [r for r, obs in enumerate(values) if not obs["zero"]]
    if plain:
        owned = values[plain[0]].get("local")
        raise CheckFailed(
            check,
            f"make_zero_optimizer returned {values[plain[0]]['type']}, not a ZeroRedundancyOptimizer"
            + (f": rank {plain[0]} holds optimizer state for all {len(owned)} parameters" if owned else ""),
            ranks=plain, expected="each rank holds the state of its own shard only", hint=hint,
        )
    wrong = [r for r, obs in enumerate(values) if obs["local_type"] != "Adam"]
    expect(not wrong, check, f"the optimizer inside ZeroRedundancyOptimizer is {values[wrong[0]]['local_type'] if wrong else ''}, "
           "not Adam", ranks=wrong, hint="optimizer_class=torch.optim.Adam")
    n = len(values[0]["params"])
    shards = [set(obs["local"]) for obs in values]
    overlap = sorted(set.intersection(*shards)) if ws > 1 else []
    union = set().union(*shards)
    expect(
        not overlap and union == set(range(n)),
        check,
        f"the optimizer state is not split into disjoint shards ({ws} ranks)",
        ranks=range(ws),
        expected=f"every one of the {n} parameters' state on exactly one rank",
        got="; ".join(f"rank {r}: {sorted(s)}" for r, s in enumerate(shards)),
        hint=hint,
    )


def _zero_state_diff(state_dict: dict, reference: dict) -> str | None:
    """Why ``state_dict`` (an Adam state_dict) differs from ``reference``, or None."""
    state, ref_state = state_dict.get("state", {}), reference["state"]
    missing = sorted(set(ref_state) - set(state))
    if missing:
        return f"no state for parameters {missing} (of {len(ref_state)}): only one rank's shard"
    for index, ref in ref_state.items():
        for key, value in ref.items():
            got = state[index].get(key)
            if not isinstance(got, torch.Tensor) or got.shape != value.shape:
                return f"parameter {index}: {key} is {type(got).__name__}, expected a tensor of shape {tuple(value.shape)}"
            if not torch.allclose(got.float(), value.float(), rtol=0, atol=ZERO_ATOL):
                return f"parameter {index}: {key} differs by {float((got.float() - value.float()).abs().max()):.3g}"
    lrs = [g.get("lr") for g in state_dict.get("param_groups", [])]
    if lrs and any(lr != ZERO_LR for lr in lrs):
        return f"learning rate {lrs[0]}, expected {ZERO_LR}"
    return None


def _zero_optimizer_job(check: str, make_zero_optimizer, world_size: int):
    return checks.memo(check, ("zero", make_zero_optimizer, world_size), lambda: checks.run(
        check, _zero_optimizer_harness, world_size, args=(make_zero_optimizer,)))


def check_zero_sharded(make_zero_optimizer) -> None:
    """Each rank holds Adam state only for its own parameters; together the ranks cover all, no overlap."""
    check = "check_zero_sharded"
    checks.require_written(check, make_zero_optimizer=make_zero_optimizer)
    _sharding_verdict(check, _zero_optimizer_job(check, make_zero_optimizer, 2).values, 2)
    passed(check)


def check_zero_matches_adam(make_zero_optimizer) -> None:
    """With 2 and 3 ranks, sharded Adam ends where single-process Adam on the global batch ends."""
    check = "check_zero_matches_adam"
    checks.require_written(check, make_zero_optimizer=make_zero_optimizer)
    for ws in (2, 3):
        job = _zero_optimizer_job(check, make_zero_optimizer, ws)
        _sharding_verdict(check, job.values, ws)
        ref_state, ref_params = _zero_reference(ws)
        why = _zero_state_diff(job.values[0]["state_dict"], ref_state)
        expect(why is None, check, f"the consolidated optimizer state differs from single-process Adam ({ws} ranks)",
               ranks=[0], expected=f"Adam(lr={ZERO_LR}) state on the global batch, within {ZERO_ATOL:g}", got=why,
               hint="ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr) with the lr given")
        for rank, obs in enumerate(job.values):
            diff = max(float((a - b).abs().max()) for a, b in zip(obs["params"], ref_params))
            expect(diff <= ZERO_ATOL, check, f"after {ZERO_STEPS} steps the parameters differ from single-process "
                   f"Adam by {diff:.3g} ({ws} ranks)", ranks=[rank], hint="use Adam with the lr given")
    passed(check)


def _zero_save_harness(rank: int, save_optimizer, dirs: list[str]) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_pg()
    model = _zero_model()
    ddp_model = DDP(model)
    optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=ZERO_LR)
    _zero_train(ddp_model, optimizer, rank)
    save_optimizer(optimizer, rank, os.path.join(dirs[rank], "optimizer.pt"))


_SAVE_MISTAKES = [
    Mistake(lambda rank, text: rank == 0 and "not been consolidated" in text,
            "rank 0 asked for optimizer.state_dict() before the state was consolidated: each rank holds only its shard",
            "call optimizer.consolidate_state_dict(to=0) on EVERY rank first, then save optimizer.state_dict() on rank 0"),
    Mistake(lambda rank, text: rank not in (0, None) and "not been consolidated" in text,
            "rank {rank} called optimizer.state_dict(): after consolidate_state_dict(to=0) only rank 0 holds the "
            "full state (saving on every rank)",
            "save only on rank 0: `if rank == 0: torch.save(optimizer.state_dict(), ckpt_path)`"),
    Mistake(lambda rank, text: "consolidate_state_dict" in text and stranded(text),
            "rank {rank} waited in consolidate_state_dict for ranks that never joined it ({ws}-rank job): "
            "it is a collective, every rank must call it (consolidating only on rank 0 hangs)",
            "call optimizer.consolidate_state_dict(to=0) on every rank, outside `if rank == 0:`; then save on rank 0"),
]


def check_zero_save(save_optimizer, world_size: int = 2) -> None:
    """The full optimizer state is consolidated on all ranks and saved by rank 0 only; it loads into Adam."""
    check = "check_zero_save"
    checks.require_written(check, save_optimizer=save_optimizer)
    root = tempfile.mkdtemp(prefix="ddp-course-ex3-")
    try:
        dirs = [os.path.join(root, f"rank{r}") for r in range(world_size)]
        for d in dirs:
            os.makedirs(d)
        checks.run(check, _zero_save_harness, world_size, args=(save_optimizer, dirs), mistakes=_SAVE_MISTAKES)
        paths = [os.path.join(d, "optimizer.pt") for d in dirs]
        others = [r for r in range(1, world_size) if os.listdir(dirs[r])]
        expect(not others, check, f"{checks.rank_list(others)} saved a file too ({world_size}-rank job)", ranks=others,
               expected="only rank 0 writes the checkpoint", hint="guard the save with `if rank == 0:`")
        expect(os.path.exists(paths[0]), check, f"rank 0 saved nothing at ckpt_path ({world_size}-rank job)",
               ranks=[0], hint="on rank 0: torch.save(optimizer.state_dict(), ckpt_path)")
        try:
            state_dict = torch.load(paths[0], map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - shown to the student
            raise CheckFailed(check, f"the saved file does not load with torch.load: {exc}", ranks=[0],
                              hint="save optimizer.state_dict() itself (a plain dict)") from None
        try:
            torch.optim.Adam(_zero_model().parameters(), lr=ZERO_LR).load_state_dict(state_dict)
        except Exception as exc:  # noqa: BLE001
            raise CheckFailed(check, f"the saved state does not load into torch.optim.Adam: "
                              f"{type(exc).__name__}: {exc}", ranks=[0],
                              hint="save the consolidated optimizer.state_dict(), not optimizer.optim.state_dict() "
                              "(one shard) or a dict wrapping it") from None
        why = _zero_state_diff(state_dict, _zero_reference(world_size)[0])
        expect(why is None, check, f"the saved optimizer state is not the full Adam state ({world_size} ranks)",
               ranks=[0], expected=f"single-process Adam's state on the global batch, within {ZERO_ATOL:g}", got=why,
               hint="consolidate_state_dict(to=0) on every rank, then save optimizer.state_dict() on rank 0")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed(check)

