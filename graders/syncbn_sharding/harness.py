"""What exercise 3's checks run and compare with, apart from their verdicts (:mod:`graders.syncbn_sharding.checks`): the models,
each rank's data, the harnesses that run on the ranks, and the single-process references (BatchNorm and
Adam on the global batch).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course import checks

#: the grader's process groups' timeout, a backstop only: the stall watch names a collective some rank skipped within
#: seconds, while on a busy 2-core grader a peer can lag by more than 15 s (CI saw it), and a right answer must not lose
PG_TIMEOUT = timedelta(seconds=60)

# BatchNorm: initial state the harness gives every layer (same on all ranks)
C = 3
#: not nn.BatchNorm's default (1e-5), and large enough to matter next to the data's variances (1 and more): a layer
#: that forgets eps, or writes 1e-5 where self.eps belongs, normalises visibly otherwise
EPS = 0.01
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
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)


#: each rank's inputs are moved by a shift of its own in [0, SHIFT), drawn in the rank from os.urandom for every job
#: (and returned to the grader): no rank can work out another's batch from the public seeds, so the global
#: statistics can only come from the ranks' exchange, never from replaying the grader's data generator
SHIFT = 0.5


def _bn_input(rank: int, sizes, tail, step: int, offset: float = 0.0, shift: float = 0.0) -> torch.Tensor:
    """Rank ``rank``'s float32 input: its own mean and spread, plus a common ``offset`` (a large offset is
    where E[x^2] - E[x]^2 cancels in float32) and its own ``shift``."""
    g = torch.Generator().manual_seed(100 * step + rank + 7)
    x = torch.randn((sizes[rank], C, *tail), generator=g)
    return x * (1.0 + rank) + 2.0 * rank - step + offset + shift


def _bn_coef(rank: int, sizes, tail, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank + 1000)
    return torch.randn((sizes[rank], C, *tail), generator=g)


def _bn_harness(rank: int, bn_cls, cases) -> list[dict]:
    """Every case in one job (a job costs more than a case): a fresh layer per case, and this rank's shift (one
    per job, :data:`SHIFT`) in every observation."""
    _init_pg()
    shift = int.from_bytes(_URANDOM(4), "little") / 2 ** 32 * SHIFT
    return [{**_bn_case(rank, bn_cls, sizes, tail, offset, shift), "shift": shift} for sizes, tail, offset in cases]


_BN_TENSOR, _BN_ALL_REDUCE = torch.tensor, checks.REAL.all_reduce  # bound before any student object exists


def _bn_case(rank: int, bn_cls, sizes, tail, offset, shift: float = 0.0) -> dict:
    """BN_STEPS training forwards, each followed by a backward (whose error, if any, is recorded, not raised:
    the forward's observations still serve the output and running-statistics checks)."""
    bn = bn_cls(C, eps=EPS, momentum=MOMENTUM)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(WEIGHT))
        bn.bias.copy_(torch.tensor(BIAS))
        bn.running_mean.copy_(torch.tensor(RUNNING_MEAN))
        bn.running_var.copy_(torch.tensor(RUNNING_VAR))
    bn.train()
    # the buffers the layer was built with: "updated in place" is judged on these very tensors (a forward that
    # puts new tensors in their place leaves them as they were), and "without gradient" on their autograd state
    buffers = {"running_mean": bn.running_mean, "running_var": bn.running_var}
    record = []
    for step in range(BN_STEPS):
        x = _bn_input(rank, sizes, tail, step, offset, shift).requires_grad_()
        y = bn(x)
        if not isinstance(y, torch.Tensor):
            return {"error": f"forward returned {type(y).__name__}, not a tensor"}
        obs = {"y": y.detach().clone()}
        for key, buffer in buffers.items():
            current = bn._buffers.get(key)
            obs[key] = buffer.detach().clone()
            obs[f"{key}_replaced"] = None if current is buffer or not isinstance(current, torch.Tensor) else \
                current.detach().clone()
            obs[f"{key}_graph"] = bool(buffer.requires_grad or buffer.grad_fn is not None)
        # the ranks agree first (a collective of the grader's) that every rank's output has a graph: a rank whose
        # output has none (an empty batch answered with fresh zeros) would run no backward exchange, and the others'
        # backward would wait for it forever, costing the forward's checks too
        ready = _BN_TENSOR([1 if y.shape == x.shape and y.requires_grad else 0])
        _BN_ALL_REDUCE(ready, op=dist.ReduceOp.MIN)
        if not int(ready.item()):
            obs["no_graph"] = not (y.shape == x.shape and y.requires_grad)
        else:
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
def _bn_reference(sizes, tail, steps: int, offset: float = 0.0, shifts: tuple | None = None) -> list[dict]:
    """nn.BatchNorm's own functional form on the global batch (all ranks' float32 inputs concatenated, each moved
    by its rank's ``shifts``), computed in float64: the truth a float32 recipe is measured against."""
    ws = len(sizes)
    running_mean = torch.tensor(RUNNING_MEAN, dtype=torch.float64)
    running_var = torch.tensor(RUNNING_VAR, dtype=torch.float64)
    weight = torch.tensor(WEIGHT, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    out = []
    for step in range(steps):
        xs = [_bn_input(r, sizes, tail, step, offset, shifts[r] if shifts else 0.0) for r in range(ws)]
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
    eps = 0.0 if variant == "no_eps" else EPS
    y = (x - mean.view(shape)) / torch.sqrt(norm_var.view(shape) + eps) \
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


def _zero_model(seed: int = 3) -> nn.Module:
    """Part 3's model: big enough that one rank's share of Adam's state is about a hundred kilobytes (a gather shows;
    the few kilobytes of metadata torch.distributed.checkpoint's planning exchanges do not), with parameters of equal
    shapes (two 128 x 128 weights, three 128-long biases: a loader that tells them apart by shape picks wrongly)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 1))


def _zero_batch(rank: int, step: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + 50 * step + rank)
    x = torch.randn(5, 48, generator=g) + rank
    return x, torch.cos(x.sum(dim=1, keepdim=True)) * (1 + rank)


def _next_grads(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """The gradients of the step after loading, the same in the reference and in the load harness."""
    g = torch.Generator().manual_seed(7 + seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@checks.reference
@torch.no_grad()
def _zero_reference(world_size: int, seed: int):
    """Single-process Adam on the global batch: its state_dict, its final parameters, and the parameters after one
    more step on :func:`_next_grads`."""
    model = _zero_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=ZERO_LR)
    for step in range(ZERO_STEPS):
        batches = [_zero_batch(rank, step, seed) for rank in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        with torch.enable_grad():
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
    state = optimizer.state_dict()
    state = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()},
             "param_groups": state["param_groups"]}
    trained = [p.detach().clone() for p in model.parameters()]
    for p, grad in zip(model.parameters(), _next_grads(model, seed)):
        p.grad = grad
    optimizer.step()
    return state, trained, [p.detach().clone() for p in model.parameters()]


# What the save harness trains and observes with, taken when this module is imported: in a rank that is while the
# job's payload is unpickled, before the student's objects, so code that runs as they are unpickled (or in an
# earlier save) cannot change how the grader trains, what it puts in the optimizer, or what it reads back.
from torch.distributed.optim import ZeroRedundancyOptimizer as _ZERO  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as _DDP  # noqa: E402

_ZERO_STEP = _ZERO.step
_ZERO_ZERO_GRAD = _ZERO.zero_grad
_ADAM = torch.optim.Adam
_BACKWARD = torch.Tensor.backward
_MSE = F.mse_loss
_COPY_ = torch.Tensor.copy_
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_RAND = torch.rand
_IS_TENSOR = torch.is_tensor
_PARAMETERS = nn.Module.parameters
_URANDOM = os.urandom

#: the two saves of the save job: first with every rank's Adam state changed (a "decoy" only that rank holds),
#: then with the trained state, the checkpoint the load check reads
SAVE_ROUNDS = ("decoy", "trained")


def _local_share(optimizer, model) -> list[tuple[int, str, torch.Tensor]]:
    """(index in model.parameters(), state key, tensor) of every tensor this rank's own Adam holds, the tensors
    themselves (not copies): ZeRO gives each rank the whole state of some parameters."""
    index = {id(p): i for i, p in enumerate(_PARAMETERS(model))}
    out = []
    for p, state in optimizer.optim.state.items():
        for key, value in state.items():
            if _IS_TENSOR(value):
                out.append((index[id(p)], key, value))
    return out


def _zero_save_harness(rank: int, save_shard, folders: list[str], seed: int, nonce: int,
                       _collectives=checks.REAL.collectives, _record_writes=checks.record_writes) -> dict:
    """Train with ZeRO (Adam), then call the student's save twice: into ``folders[0]`` with this rank's share of
    the state replaced by a decoy of its own (random, drawn in this rank and returned to the grader), then,
    the trained share put back, into ``folders[1]``. Observe every file this rank wrote in each save and every
    collective it issued (torch's flight recorder: what crossed between the ranks)."""
    _init_pg()
    model = _zero_model(seed)
    ddp_model = _DDP(model)
    optimizer = _ZERO(ddp_model.parameters(), optimizer_class=_ADAM, lr=ZERO_LR)
    for step in range(ZERO_STEPS):
        x, y = _zero_batch(rank, step, seed)
        loss = _MSE(ddp_model(x), y)
        _ZERO_ZERO_GRAD(optimizer)
        _BACKWARD(loss)
        _ZERO_STEP(optimizer)
    share = [(i, key, t) for i, key, t in _local_share(optimizer, model) if t.dim() > 0]  # exp_avg, exp_avg_sq
    trained = [_CLONE(_DETACH(t)) for _, _, t in share]
    # drawn here, from this rank's own os.urandom: no other rank can know them (the grader gets them with the result)
    g = torch.Generator().manual_seed(int.from_bytes(_URANDOM(7), "little") ^ nonce)
    decoys = [t + 1.0 + _RAND(t.shape, generator=g) for t in trained]  # >= 1 away from the trained values
    rounds = []
    for name, folder in zip(SAVE_ROUNDS, folders):
        with torch.no_grad():
            for (_, _, t), value in zip(share, decoys if name == "decoy" else trained):
                _COPY_(t, value)
        seen = {(e["group"], e["seq"], e["p2p"]) for e in _collectives()}  # bound at import: no module global
        with _record_writes() as writes:  # every file this rank writes, however it writes it
            save_shard(optimizer, model, rank, folder)
        issued = [e for e in _collectives() if (e["group"], e["seq"], e["p2p"]) not in seen]
        rounds.append({"round": name, "writes": sorted({e["path"] for e in writes}),
                       "left": sorted({e["path"] for e in writes if os.path.exists(e["path"])}),  # temporaries gone
                       "moved": sum(_entry_bytes(e) for e in issued), "ops": [e["op"] for e in issued]})
    held = [[i, key] for i, key, _ in share]
    return {"rounds": rounds, "held": held, "trained": trained, "decoys": decoys}


_ITEMSIZE = {"Float": 4, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1, "Bool": 1, "Half": 2,
             "BFloat16": 2, "Short": 2}


def _entry_bytes(entry: dict) -> int:
    """The bytes of a collective's inputs, from the shapes and dtypes the flight recorder saw."""
    return sum(math.prod(size) * _ITEMSIZE.get(dtype, 8)
               for size, dtype in zip(entry.get("sizes") or [], entry.get("dtypes") or []))


def _zero_load_harness(rank: int, load_full_state, folders: list[str], seed: int, trained: list) -> list[dict]:
    """In one process, no process group: for each folder, the student's loader builds the state dict and a plain Adam
    over the model loads it. For the first folder, Adam then makes one more step. Returns, per folder, what Adam
    holds (and, for the first, the parameters after that step), or the error."""
    out = []
    for n, folder in enumerate(folders):
        model = _zero_model(seed)
        with torch.no_grad():
            for p, value in zip(model.parameters(), trained):
                p.copy_(value)
        try:
            state = load_full_state(folder, model)
        except Exception as exc:  # noqa: BLE001 - shown to the student
            if n == 0:
                raise
            out.append({"load_error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        optimizer = torch.optim.Adam(model.parameters(), lr=ZERO_LR)
        try:
            optimizer.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - shown to the student
            out.append({"error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        loaded = checks.to_cpu(optimizer.state_dict())
        if n:
            out.append({"state": loaded})
            continue
        for p, grad in zip(model.parameters(), _next_grads(model, seed)):
            p.grad = grad
        try:
            optimizer.step()
        except Exception as exc:  # noqa: BLE001
            out.append({"state": loaded, "step_error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        out.append({"state": loaded, "after": [p.detach().clone() for p in model.parameters()]})
    return out
