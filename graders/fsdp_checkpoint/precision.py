"""Checks for mixed precision and clipping with FSDP2 (exercises/ex3-syncbn-sharding/fsdp_checkpoint.ipynb,
part 5; issue 28 part 2, its FSDP half).

* ``shard_mixed(model)`` shards the model with FSDP2 so that it computes in bfloat16, returns float32 outputs
  and reduces its gradients in float32, keeping float32 master weights. :func:`check_mixed_precision` runs one
  forward and backward of the grader's own on the sharded model and judges what happened: the dtype of every
  parameter shard, the dtype each collective really carried (:mod:`graders.common.comm_spy`, torch's own ops, taken
  at import), the dtype of the output, and the gradients against a one-process reference that computes each rank's batch in bfloat16 and
  averages in float32.
* ``clip_gradients(model, max_norm)`` is called by the grader's training step (MSE loss, a model the grader
  shards, float32) between backward and the optimizer's step: it clips the gradients to ``max_norm`` by their
  *global* norm (over every rank's shards) and returns that norm, measured before clipping. :func:`check_clipping` compares the norms each
  rank returned and the weights after three steps (clipping engaged, not engaged, engaged) with one
  process training on the global batch with ``torch.nn.utils.clip_grad_norm_``.

Tolerances. bfloat16 keeps 8 significant bits, so one rounding changes a value by up to 2**-9 of it. The
reference repeats every bfloat16 operation of a right answer, so its gradients differ from FSDP2's only in
the float32 order of the sum over ranks (about 1e-7 relative). :data:`BF16_TOL` (2**-12 of the tensor's
largest value) allows for that and is more than ten times below what a gradient computed in float32 or
reduced in bfloat16 changes on these models (3e-3 to 1.4e-2 relative, measured by the tests). The dtype
each collective carried is judged directly, before the values.
Clipping is judged in float32 at :data:`FP32_TOL`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from course import checks
from course.checks import CheckFailed, passed
from graders.common import comm_spy
from graders.fsdp_checkpoint.harness import _shard_of  # rank r's rows of a tensor as FSDP2 shards dim 0

INPUTS, OUTPUTS, BATCH = 6, 3, 5
BF16_TOL = 2.0**-12
FP32_TOL = 1e-5
LR = 0.1

# taken when this module is imported (in a rank: before the student's objects are unpickled)
_DTENSOR = DTensor
_TO_LOCAL = DTensor.to_local
_FULL_TENSOR = DTensor.full_tensor


class Net(nn.Module):
    """``embed`` -> ``blocks`` (an ``nn.ModuleList`` of ``Linear`` + tanh) -> ``head``."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(INPUTS, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, OUTPUTS)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return self.head(x)


def make_net(width: int, depth: int, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(width, depth)


def batch(rank: int, step: int, seed: int):
    g = torch.Generator().manual_seed(7919 * seed + 97 * step + rank)
    x = torch.randn(BATCH, INPUTS, generator=g) * (1 + rank)
    y = torch.randn(BATCH, OUTPUTS, generator=g)
    return x, y


def _local(t) -> torch.Tensor:
    return _TO_LOCAL(t) if isinstance(t, _DTENSOR) else t


def _where(world_size, width, depth, seed) -> str:
    return f"(world_size={world_size}, width={width}, depth={depth}, seed={seed})"


# --- 1. mixed precision --------------------------------------------------------------------------------------


def _mixed_harness(rank, shard_mixed, width, depth, seed):
    checks.join_job()
    model = make_net(width, depth, seed)
    shard_mixed(model)
    dtypes = {name: str(_local(p).dtype) for name, p in model.named_parameters()}
    records, out_dtype = [], None
    if all(d == "torch.float32" for d in dtypes.values()):  # else the verdict names that; no forward to fail
        x, y = batch(rank, 0, seed)
        mode, records = comm_spy.spy()
        with mode:
            out = model(x)
            out_dtype = str(out.dtype)
            F.mse_loss(out.float(), y).backward()
    params = {}
    for name, p in model.named_parameters():
        local = _local(p)
        grad = None if p.grad is None else _local(p.grad)
        params[name] = {"sharded": isinstance(p, _DTENSOR), "dtype": str(local.dtype), "numel": local.numel(),
                        "grad": None if grad is None else grad.detach().float().clone(),
                        "grad_dtype": None if grad is None else str(grad.dtype)}
    sent = [(r["op"], r["dtypes"]) for r in records if r["op"] in ("all_gather", "reduce_scatter", "all_reduce")]
    return {"params": params, "sent": sent, "out_dtype": out_dtype}


@checks.reference
def _mixed_reference(world_size, width, depth, seed):
    """Each parameter's gradient as a right answer reduces it: each rank's bfloat16 gradient, averaged in float32."""
    total = None
    for rank in range(world_size):
        model = make_net(width, depth, seed).to(torch.bfloat16)
        x, y = batch(rank, 0, seed)
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
    return {n: g / world_size for n, g in total.items()}


def check_mixed_precision(shard_mixed, world_size=2, width=8, depth=2, seed=0):
    """The model computes in bfloat16, gathers bfloat16 parameters, returns float32 outputs, reduces float32
    gradients, keeps float32 shards."""
    check = "check_mixed_precision"
    checks.require_written(check, shard_mixed=shard_mixed)
    where = _where(world_size, width, depth, seed)
    job = checks.run(check, _mixed_harness, world_size, args=(shard_mixed, width, depth, seed),
                     expected="shard_mixed(model) shards the model in place with FSDP2 and returns")
    want = _mixed_reference(world_size, width, depth, seed)

    def verdict(rank, obs):
        params = obs["params"]
        unsharded = [n for n, p in params.items() if not p["sharded"]]
        checks.expect(not unsharded, check, f"some parameters are not sharded {where}", ranks=[rank],
                      expected="every parameter a DTensor shard (fully_shard on each block, then on the model)",
                      got=f"plain tensors: {unsharded}", hint="apply fully_shard to every block, then to the whole model")
        low = {n: p["dtype"] for n, p in params.items() if p["dtype"] != "torch.float32"}
        checks.expect(not low, check, f"the parameters themselves are not float32 {where}", ranks=[rank],
                      expected="float32 shards (the master weights the optimizer updates)", got=f"{low}",
                      hint="do not cast the model to bfloat16: an update smaller than bfloat16's resolution "
                           "(2**-8 of a weight) would be lost. Ask FSDP2 to compute in bfloat16 instead "
                           "(its mixed-precision policy's param_dtype)")
        gathers = [dt for op, dt in obs["sent"] if op == "all_gather"]
        reduces = [dt for op, dt in obs["sent"] if op in ("reduce_scatter", "all_reduce")]
        checks.expect(gathers and all(d == ["torch.bfloat16"] for d in gathers), check,
                      f"the forward did not gather bfloat16 parameters {where}", ranks=[rank],
                      expected="every all-gather carries bfloat16 (half the bytes of float32)",
                      got=f"all-gathers carried {sorted({str(d) for d in gathers}) or 'nothing'}",
                      hint="set the policy's param_dtype to torch.bfloat16: FSDP2 then casts each gathered "
                           "parameter and the block computes in bfloat16 (autocast alone still gathers float32)")
        checks.expect(reduces and all(d == ["torch.float32"] for d in reduces), check,
                      f"the gradients were not reduced in float32 {where}", ranks=[rank],
                      expected="every reduce-scatter carries float32",
                      got=f"gradient reductions carried {sorted({str(d) for d in reduces}) or 'nothing'}",
                      hint="set the policy's reduce_dtype to torch.float32: a sum over ranks in bfloat16 rounds "
                           "every partial sum to 8 bits")
        checks.expect(obs["out_dtype"] == "torch.float32", check, f"the model's output is not float32 {where}",
                      ranks=[rank], expected="the model returns float32 (the caller's loss is then computed in float32)",
                      got=f"it returned {obs['out_dtype']}",
                      hint="the units compute in bfloat16, and only what the whole model returns is cast to float32: "
                           "a unit's FSDP2 policy can say in which dtype the unit returns its outputs (the outermost "
                           "unit's; the activations between units stay bfloat16), or cast the output yourself")
        for name, p in params.items():
            shard = _shard_of(want[name], world_size, rank)
            got = p["grad"]
            scale = max(want[name].abs().max().item(), 1e-12)
            ok = got is not None and got.shape == shard.shape and (got - shard).abs().max().item() <= BF16_TOL * scale
            checks.expect(ok, check, f"the gradient of {name} is not the average of every rank's bfloat16 gradient "
                          f"{where}", ranks=[rank],
                          expected=f"within {BF16_TOL:g} x {scale:.3g} of the reference (each rank's batch in "
                                   "bfloat16, averaged in float32)",
                          got="no gradient" if got is None else
                          f"largest difference {(got - shard).abs().max().item():.3g}" if got.shape == shard.shape
                          else f"a shard of shape {tuple(got.shape)}, expected {tuple(shard.shape)}",
                          hint="one FSDP2 mixed-precision policy for every unit: bfloat16 compute, float32 reduction")

    checks.on_every_rank(job.values, verdict)
    passed(check)


# --- 2. clipping ------------------------------------------------------------------------------------------


def _as_float(norm) -> float | str:
    if isinstance(norm, _DTENSOR):
        norm = _FULL_TENSOR(norm)
    try:
        return float(norm)
    except (TypeError, ValueError, RuntimeError):
        return f"<{type(norm).__name__}>"


def _clipping_harness(rank, clip_gradients, width, depth, seed, max_norms):
    from torch.distributed.fsdp import fully_shard

    checks.join_job()
    model = make_net(width, depth, seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms, weights = [], []
    for step, max_norm in enumerate(max_norms):
        x, y = batch(rank, step, seed)
        optimizer.zero_grad()  # the exercise's given training step, around the student's clipping
        F.mse_loss(model(x), y).backward()
        norms.append(_as_float(clip_gradients(model, max_norm)))
        optimizer.step()
        weights.append({n: _local(p).detach().float().clone() for n, p in model.named_parameters()})
    return {"norms": norms, "weights": weights}


FACTORS = (0.5, 10.0, 0.3)  # max_norm as a fraction of the first step's norm: clipped, not clipped, clipped


@checks.reference
def _clipping_reference(world_size, width, depth, seed, factors=FACTORS):
    """One process on the global batch, step by step: weights before and after, the global gradients, the norm
    before clipping, each rank's shard norm, max_norm."""
    model = make_net(width, depth, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps, base = [], None
    for step, factor in enumerate(factors):
        parts = [batch(r, step, seed) for r in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        total = _norm(grads.values())
        base = total if base is None else base  # the first step's norm sets the scale of every max_norm
        local = [_norm(_shard_of(g, world_size, r) for g in grads.values()) for r in range(world_size)]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), factor * base).item()
        optimizer.step()
        steps.append({"before": before, "grads": grads, "norm": norm, "local": local, "max_norm": factor * base,
                      "after": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return steps


def _norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])).item()


def _coef(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))  # clip_grad_norm_'s factor


def _variants(step: dict, rank: int, world_size: int) -> dict[str, dict]:
    """The weights after the step of known mistakes (from the reference's weights before it): name -> weights."""
    m, total, lr = step["max_norm"], step["norm"], LR
    g, w = step["grads"], step["before"]
    return {
        "no clipping": {n: w[n] - lr * g[n] for n in g},
        "each parameter clipped by its own norm": {n: w[n] - lr * g[n] * _coef(m, _norm([g[n]])) for n in g},
        "each rank clipped by the norm of its own shards": {
            n: w[n] - lr * g[n] * _coef(m, step["local"][rank]) for n in g},
        "every gradient scaled to max_norm, even below it": {n: w[n] - lr * g[n] * (m / (total + 1e-6)) for n in g},
    }


_VARIANT_HINTS = {
    "no clipping": "scale the gradients in place (clip_gradients runs after backward, before the given step): "
                   "measuring their norm is not enough",
    "each parameter clipped by its own norm": "clip all the gradients together, by their one total norm",
    "each rank clipped by the norm of its own shards": (
        "each rank holds 1/N of every gradient: the global norm is the square root of the sum over ranks of "
        "each rank's sum of squares (clip_grad_norm_ on the DTensor parameters does that; a norm of "
        "p.grad.to_local() does not)"),
    "every gradient scaled to max_norm, even below it": "scale by max_norm / norm only when the norm exceeds max_norm",
}


def _close_weights(got: dict, want: dict, world_size: int, rank: int) -> float | None:
    """The largest difference between a rank's shards and the same rows of ``want`` (None: shapes differ)."""
    worst = 0.0
    for name, w in got.items():
        shard = _shard_of(want[name], world_size, rank)
        if w.shape != shard.shape:
            return None
        worst = max(worst, (w - shard).abs().max().item())
    return worst


def check_clipping(clip_gradients, world_size=2, width=8, depth=2, seed=0):
    """Called between each step's backward and optimizer step, every rank clips by the global gradient norm and
    returns it; the weights follow one process that clips."""
    check = "check_clipping"
    checks.require_written(check, clip_gradients=clip_gradients)
    where = _where(world_size, width, depth, seed)
    ref = _clipping_reference(world_size, width, depth, seed)
    job = checks.run(check, _clipping_harness, world_size,
                     args=(clip_gradients, width, depth, seed, [s["max_norm"] for s in ref]),
                     expected="clip_gradients(model, max_norm) clips the gradients in place and returns the norm")

    def verdict(rank, obs):
        for k, (step, got, weights) in enumerate(zip(ref, obs["norms"], obs["weights"])):
            want, max_norm = step["norm"], step["max_norm"]
            engaged = "clipping engaged" if want > max_norm else "no clipping needed"
            if not (isinstance(got, float) and abs(got - want) <= FP32_TOL * max(want, 1.0)):
                local = step["local"][rank]
                if isinstance(got, float) and abs(got - local) <= FP32_TOL * max(local, 1.0):
                    problem, hint = ("the norm returned is that of the rank's own shards, not of the whole gradient",
                                     _VARIANT_HINTS["each rank clipped by the norm of its own shards"])
                elif isinstance(got, float) and abs(got - min(max_norm, want)) <= FP32_TOL * max(want, 1.0):
                    problem, hint = ("the norm returned is the one after clipping",
                                     "return the total norm measured before clipping (what clip_grad_norm_ returns)")
                else:
                    problem, hint = ("the norm returned is not the global gradient norm",
                                     "measure the norm after backward, over every parameter's whole gradient")
                raise CheckFailed(check, f"step {k} ({engaged}): {problem} {where}", ranks=[rank],
                                  expected=f"{want:.6g} (max_norm {max_norm:.4g})", got=f"{got}", hint=hint)
            diff = _close_weights(weights, step["after"], world_size, rank)
            if diff is not None and diff <= FP32_TOL:
                continue
            named = [name for name, w in _variants(step, rank, world_size).items()
                     if (d := _close_weights(weights, w, world_size, rank)) is not None and d <= FP32_TOL]
            mistake = named[0] if named else None
            raise CheckFailed(
                check, f"step {k} ({engaged}): the weights after the step are not those of clipping by the global "
                       f"norm{f': {mistake}' if mistake else ''} {where}", ranks=[rank],
                expected=f"one process on the global batch, clip_grad_norm_(parameters, {max_norm:.4g}), SGD step",
                got=f"largest difference {diff:.3g}" if diff is not None else "shards of another shape",
                hint=_VARIANT_HINTS.get(mistake, "scale every gradient, in place, by the same factor "
                                                 "min(1, max_norm / global norm)"))

    checks.on_every_rank(job.values, verdict)
    passed(check)
