"""Checks for exercise 1, part 4: tensor parallelism by hand (exercises/ex1-parallelism/parallelism.ipynb).

The student writes ``tensor_parallel_mlp(mlp, rank, world_size)``: given the two-layer MLP ``Linear(d_in, hidden) ->
Tanh -> Linear(hidden, d_out)`` with only this rank's shards filled in (a block of the hidden units: rows of the
first weight and bias, columns of the second weight; the second bias whole; every other entry NaN), it returns a
module that holds those shards and whose forward gives the whole MLP's output on every rank.

Each rank draws its own shards, in the harness, from the OS's randomness (:func:`_private_shard`, with
``os.urandom`` taken when this module is imported), before any of the student's code is called: no other rank, and
no public seed, knows them. The whole MLP the checks compare with is put together in the grader's process from the
ranks' returned shards (immutable tuples of floats). So a rank can only produce the whole output, or the input's
whole gradient, from what the other ranks send it: a module that computes locally (the whole model it was given, one
rebuilt from the checks' seed found in the caller's frames) gets NaN or another MLP's numbers, and a decoy
all-reduce of the right partial values whose result is then ignored leaves an output that is not the all-reduce's
sum.

Two checks read one job (:func:`course.checks.memo`):

* :func:`check_tensor_parallel`: the output, the input's gradient and every parameter's gradient equal the unsplit
  model's (its weights sliced), on every rank, for every world size;
* :func:`check_tensor_parallel_collectives`: each forward ran exactly one all-reduce, of the output's size, carrying
  this rank's partial output; each backward exactly one, of the input's size, carrying this rank's partial input
  gradient; nothing else; and what the ranks got back is what they used: every rank's output is the sum of what all
  the ranks' forward all-reduces carried (plus the bias), and its ``x.grad`` the sum of what their backward
  all-reduces carried (both summed here, in the grader's process). Counted and sized by torch's flight recorder and
  read by the spy on torch's collective ops (:mod:`graders.common.comm_spy`), both set up before any student object
  exists: renaming, patching or faking ``torch.distributed`` functions changes neither; the harness holds its
  references to them (and to ``os.urandom``) as default arguments, bound when this module was first imported, so
  reloading or re-executing this module from the student's code does not reach the running harness.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn as nn

from course import checks
from course.checks import CheckFailed, passed
from graders.common import comm_spy

ATOL = 1e-5  # float32 partial sums added in another order: ~1e-7 here
DIMS = (4, 6, 12, 5)  # batch, d_in, hidden, d_out (hidden divisible by 2, 3 and 4)
ROUNDS = 2  # forward + backward passes per job, on different inputs
_REAL = checks.REAL

try:  # torch's DTensor, taken now: an answer may use torch.distributed.tensor.parallel
    from torch.distributed.tensor import DTensor as _DTensor
    _TO_LOCAL = _DTensor.to_local
except ImportError:  # pragma: no cover - every torch the course supports has it
    _DTensor, _TO_LOCAL = None, None

_NAN = ("the result holds NaN: the module used entries of the weights outside this rank's shard (each rank is given "
        "only its own shards; every other entry of the sharded weights is NaN)",
        "keep and use only this rank's block: rows rank*k..(rank+1)*k-1 of the first weight and bias, the same columns "
        "of the second weight (k = hidden / world_size); the other ranks' parts of the output reach this rank through "
        "the all-reduce. With torch's parallelize_module, pass src_data_rank=None so that each rank keeps its own "
        "entries instead of rank 0's")
_SUM_HINT = ("each rank holds a part of the dot products (its block of hidden units): the whole value is the SUM of "
             "the ranks' parts, as the all-reduce returns it (data parallelism averages whole gradients; not this)")
_SHAPE_HINT = ("nn.Linear's weight has shape (out_features, in_features) and computes x @ weight.T + bias: the "
               "column-parallel layer keeps a block of ROWS of its weight (some output features) and the same entries "
               "of its bias; the row-parallel layer keeps the same block of COLUMNS of its weight (its input features) "
               "and the whole bias")


# --- the model and data --------------------------------------------------------------------------------


def make_mlp(seed: int, d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    """The MLP's shape and its second bias (public, the same on every rank); the sharded weights are each rank's own
    (:func:`_private_shard`)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def _private_shard(dims, world_size: int, _urandom=os.urandom, _from_bytes=int.from_bytes) -> tuple:
    """This rank's shards, drawn from the OS's randomness: (rows of the first weight, entries of the first bias,
    columns of the second weight), each a tuple of Python floats (row-major), uniform in nn.Linear's init range.

    Plain Python arithmetic on bytes from ``os.urandom`` (taken when this module was imported): nothing the
    student's code patches in torch changes the values, and the tuples cannot be changed in place."""
    _, d_in, hidden, d_out = dims
    k = hidden // world_size
    sizes, bounds = (k * d_in, k, d_out * k), (d_in ** -0.5, d_in ** -0.5, hidden ** -0.5)
    raw = _urandom(2 * sum(sizes))
    values = [(_from_bytes(raw[2 * i:2 * i + 2], "little") / 32767.5 - 1.0) for i in range(sum(sizes))]
    out, at = [], 0
    for size, bound in zip(sizes, bounds):
        out.append(tuple(v * bound for v in values[at:at + size]))
        at += size
    return tuple(out)


def _given_mlp(seed: int, dims, world_size: int, rank: int, shard) -> nn.Sequential:
    """The MLP a rank is given: its own shards in place, NaN in every other entry of the sharded weights."""
    _, d_in, hidden, d_out = dims
    mlp = make_mlp(seed, d_in, hidden, d_out)
    blk = _block(hidden, world_size, rank)
    k = blk.stop - blk.start
    with torch.no_grad():
        for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight):
            p.fill_(float("nan"))
        mlp[0].weight[blk] = torch.tensor(shard[0], dtype=torch.float32).reshape(k, d_in)
        mlp[0].bias[blk] = torch.tensor(shard[1], dtype=torch.float32)
        mlp[2].weight[:, blk] = torch.tensor(shard[2], dtype=torch.float32).reshape(d_out, k)
    return mlp


def _assembled(seed: int, dims, shards: list) -> tuple:
    """(w1, b1, w2, b2): the whole MLP the ranks' shards make up (in the grader's process)."""
    _, d_in, hidden, d_out = dims
    world_size = len(shards)
    k = hidden // world_size
    b2 = make_mlp(seed, d_in, hidden, d_out)[2].bias.detach()
    w1 = torch.cat([torch.tensor(s[0], dtype=torch.float32).reshape(k, d_in) for s in shards])
    b1 = torch.cat([torch.tensor(s[1], dtype=torch.float32) for s in shards])
    w2 = torch.cat([torch.tensor(s[2], dtype=torch.float32).reshape(d_out, k) for s in shards], dim=1)
    return w1, b1, w2, b2


def _inputs(seed: int, dims, k: int):
    """Round k's input (batch, d_in) and the fixed weights of the loss, sum(output * probe)."""
    batch, d_in, _, d_out = dims
    gen = torch.Generator().manual_seed(3000 + 17 * seed + k)
    return torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen)


def _block(hidden: int, world_size: int, rank: int) -> slice:
    k = hidden // world_size
    return slice(rank * k, (rank + 1) * k)


def _unsplit(weights: tuple, seed: int, dims: tuple, k: int) -> dict:
    """The whole MLP (``weights``: :func:`_assembled`) on round k's input: output, every gradient, and the pieces
    the ranks' partial sums are made of."""
    mlp = make_mlp(seed, *dims[1:])
    with torch.no_grad():
        for p, value in zip(mlp.parameters(), weights):
            p.copy_(value)
    x, probe = _inputs(seed, dims, k)
    x.requires_grad_()
    z = mlp[0](x)
    z.retain_grad()
    h = mlp[1](z)
    y = mlp[2](h)
    (y * probe).sum().backward()
    w1, b1, w2, b2 = (p.detach() for p in mlp.parameters())
    g1, gb1, g2, gb2 = (p.grad.detach() for p in mlp.parameters())
    with torch.no_grad():
        y_input_summed = {ws: mlp(x * ws) for ws in range(2, 9)}  # the input all-reduced in forward
    return {"y": y.detach(), "x_grad": x.grad.detach(), "z_grad": z.grad.detach(), "h": h.detach(),
            "params": (w1, b1, w2, b2), "grads": (g1, gb1, g2, gb2), "y_input_summed": y_input_summed}


# --- the harness (runs on every rank) ----------------------------------------------------------------


def _mark(collectives=_REAL.collectives) -> dict:
    """Each group's last sequence number so far (collectives and point-to-point apart)."""
    mark: dict = {}
    for e in collectives():
        key = (e["group"], e["p2p"])
        mark[key] = max(mark.get(key, 0), (e["p2p_seq"] if e["p2p"] else e["seq"]) or 0)
    return mark


def _since(mark: dict, collectives=_REAL.collectives) -> list[dict]:
    out = []
    for e in collectives():
        if ((e["p2p_seq"] if e["p2p"] else e["seq"]) or 0) > mark.get((e["group"], e["p2p"]), 0):
            out.append({"op": e["op"], "numels": [math.prod(s) for s in e["sizes"] or []], "dtypes": e["dtypes"],
                        "shapes": [list(s) for s in e["sizes"] or []]})
    return out


def _local(t):
    """A tensor's values on this rank (a DTensor's local shard), detached on the CPU; None stays None."""
    if t is None:
        return None
    if _DTensor is not None and isinstance(t, _DTensor):
        t = _TO_LOCAL(t)
    return t.detach().to("cpu", torch.float32).clone() if isinstance(t, torch.Tensor) else f"<{type(t).__name__}>"


#: the collectives whose results the marker moves (:func:`graders.common.comm_spy.marker`) in each round's second, marked
#: pass: there a rank's output (its x.grad) must carry the numbers, as a value that came out of the collective does
MARKED = ("all_reduce", "all_gather")
MARKED_INPUTS = 500  # the marked pass of round k runs on round k + 500's input


def _harness(rank, build, seed, dims, rounds, _world_size=_REAL.get_world_size, _draw=_private_shard,
             _spy=comm_spy.spy, _marker=comm_spy.marker, _nothing=contextlib.nullcontext, _mark=_mark, _since=_since,
             _local=_local):
    # the references the harness acts and observes with are default arguments: bound when this module was first
    # imported (in a rank, before any student object is unpickled), so a reload or re-execution of this module
    # by the student's code rebinds the module's names, never these
    dev = checks.join_job()
    world_size = _world_size()
    shard = _draw(dims, world_size)  # this rank's own weights: no other process knows them
    mlp = _given_mlp(seed, dims, world_size, rank, shard).to(dev)
    out = {"module": None, "rounds": [], "shard": shard}
    module = build(mlp, rank, world_size)
    if not isinstance(module, nn.Module):
        return {"module": type(module).__name__, "rounds": [], "shard": shard}
    params = list(module.parameters())
    for k in range(rounds):
        for marked in (False, True):  # each round twice: as it is, then with the marker on another input
            for p in params:
                p.grad = None
            x, probe = (t.to(dev) for t in _inputs(seed, dims, k + MARKED_INPUTS * marked))
            x.requires_grad_()
            mark = _mark()
            spy, carried_forward = _spy()
            marks, marked_forward = _marker(MARKED, with_kind=True) if marked else (_nothing(), [])
            with marks, spy:  # the spy, innermost, copies what was sent before the marker moves it
                y = module(x)
            forward = _since(mark)
            mark = _mark()
            spy, carried_backward = _spy()
            marks, marked_backward = _marker(MARKED, with_kind=True) if marked else (_nothing(), [])
            if isinstance(y, torch.Tensor) and y.shape == probe.shape and y.requires_grad:
                with marks, spy:
                    (y * probe).sum().backward()
            backward = _since(mark)
            out["rounds"].append({
                "marked": marked, "y": _local(y) if isinstance(y, torch.Tensor) else f"<{type(y).__name__}>",
                "x_grad": _local(x.grad), "params": [(_local(p), _local(p.grad)) for p in params],
                "forward": forward, "backward": backward,
                "carried_forward": [r for r in carried_forward if r["op"] in comm_spy.SENDS],
                "carried_backward": [r for r in carried_backward if r["op"] in comm_spy.SENDS],
                "marked_forward": [tuple(m) for m in marked_forward],
                "marked_backward": [tuple(m) for m in marked_backward]})
    return out


_MISTAKES = [
    checks.Mistake(lambda rank, text: "cannot be multiplied" in text or "size of tensor a" in text,
                   "a matrix product's shapes do not match on rank {rank}: a weight sliced along the wrong dimension?",
                   _SHAPE_HINT, expected="the shards' shapes to fit the inputs each layer gets",
                   got=r"mat1 and mat2 shapes cannot be multiplied[^\n]*|The size of tensor a[^\n]*"),
]


def _observe(check, build, world_size, seed, dims, rounds):
    checks.require_written(check, tensor_parallel_mlp=build)
    key = ("ex1_tp", build, world_size, seed, tuple(dims), rounds)
    hints = [("timeout", "every rank must run the same all-reduces, in the same order, with tensors of the same "
                         "shape: one in each forward (the output) and one in each backward (the input's gradient)")]
    job = checks.memo(check, key, lambda: checks.run(check, _harness, world_size, args=(build, seed, tuple(dims), rounds),
                                                     hints=hints, mistakes=_MISTAKES).values)
    for rank, obs in enumerate(job):
        if obs["module"] is not None:
            raise CheckFailed(check, f"tensor_parallel_mlp returned a {obs['module']}, not a module", ranks=[rank],
                              expected="an nn.Module whose parameters are this rank's shards and whose forward gives "
                              "the MLP's output", hint="return an nn.Module (nn.Sequential of your layers works)")
    return job


def _close(a, b, atol=ATOL) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool((a - b).abs().max() <= atol)


def _where(world_size, dims, seed) -> str:
    batch, d_in, hidden, d_out = dims
    return f"world_size={world_size}, Linear({d_in}, {hidden}) -> Tanh -> Linear({hidden}, {d_out}), batch {batch}, seed {seed}"


# --- the values --------------------------------------------------------------------------------------


def _judge_every_round(check, judge, tensor_parallel_mlp, world_sizes, seed, dims, rounds):
    """``judge(check, rank, got, want, world_size, dims, where)`` on every rank of every round of each world size's job."""
    for world_size in world_sizes:
        if dims[2] % world_size:
            raise ValueError(f"hidden={dims[2]} is not divisible by world_size={world_size}")
        job = _observe(check, tensor_parallel_mlp, world_size, seed, dims, rounds)
        where = _where(world_size, dims, seed)
        weights = _assembled(seed, dims, _shards(check, job, dims, world_size))
        for k in range(2 * rounds):  # each round's pass as it is, then its marked pass
            want = _unsplit(weights, seed, tuple(dims), k // 2 + MARKED_INPUTS * (k % 2))
            seen = [dict(obs["rounds"][k]) for obs in job]
            for phase in ("forward", "backward"):  # what every rank got back from its all-reduce, summed here
                sent = [_one_sent(got[f"carried_{phase}"]) for got in seen]
                summed = None if any(v is None or v.shape != sent[0].shape for v in sent) else sum(sent)
                for got in seen:
                    got[f"summed_{phase}"] = summed
                _marks(check, phase, seen)
            checks.on_every_rank(seen, lambda rank, got, want=want, ws=world_size, where=where: judge(
                check, rank, got, want, ws, dims, where))
    passed(check)


def _one_sent(carried: list):
    """The values of a phase's one collective seen carrying values (flat), or None if it had not exactly one."""
    values = [v for r in carried for v in r["values"]]
    return values[0] if len(carried) == 1 and len(values) == 1 else None


def _marks(check, phase, seen) -> None:
    """Each rank's ``delivered_{phase}``: whether, in a marked pass, the phase's collectives delivered the ranks'
    secret numbers (:data:`MARKED`) on top of what was sent; and ``reduced_{phase}``: the sum the phase's one
    all-reduce delivered on top of what was sent (0.0 in a pass without the marker; None unless every rank ran
    exactly one). A marked pass whose record is missing where torch's flight recorder lists a collective it marks
    was tampered with."""
    marks = [got.get(f"marked_{phase}") for got in seen]
    bad = [r for r, m in enumerate(marks) if not isinstance(m, list) or not all(
        isinstance(e, tuple) and len(e) == 2 and e[0] in MARKED and isinstance(e[1], float) and 0.5 <= e[1] < 1
        for e in m)]
    ran = [r for r, got in enumerate(seen) if got.get("marked") is not False and not marks[r] and any(
        ("reduce" in c["op"] or "gather" in c["op"]) and any(d in ("Float", "Half", "BFloat16", "Double")
                                                              for d in c.get("dtypes") or [])
        for c in got[phase])]
    if bad or ran:
        raise CheckFailed(check, "the grader's record of what the collectives delivered was changed",
                          ranks=sorted(set(bad) | set(ran)), expected="the harness's record, as it was made",
                          got=f"the {phase}'s collectives ran (torch's flight recorder lists them) but their record "
                          "is missing or altered", hint="leave the grader's objects alone")
    reduces = [[n for kind, n in m if kind == "all_reduce"] for m in marks]
    if seen[0].get("marked") is False:
        reduced = 0.0
    else:
        reduced = sum(r[0] for r in reduces) if all(len(r) == 1 for r in reduces) else None
    for got in seen:
        got[f"delivered_{phase}"], got[f"reduced_{phase}"] = any(marks), reduced


def _shards(check, job, dims, world_size) -> list:
    """Each rank's own shards, as its harness drew them (tuples of floats of the shard's sizes)."""
    _, d_in, hidden, d_out = dims
    k = hidden // world_size
    sizes = (k * d_in, k, d_out * k)
    shards = [obs.get("shard") for obs in job]
    bad = [r for r, s in enumerate(shards) if not (isinstance(s, (tuple, list)) and len(s) == 3 and all(
        isinstance(part, (tuple, list)) and len(part) == n and all(isinstance(v, float) for v in part)
        for part, n in zip(s, sizes)))]
    if bad:
        raise CheckFailed(check, "the grader's record of the shards it gave the ranks was changed", ranks=bad,
                          expected="the harness's record of each rank's shards, as drawn",
                          hint="leave the grader's objects alone: use only the MLP your function is given")
    return shards


def check_tensor_parallel(tensor_parallel_mlp, *, world_sizes=(2, 3), seed=0, dims=DIMS, rounds=ROUNDS):
    """The split MLP gives the unsplit model's output, input gradient and parameter gradients on every rank."""
    _judge_every_round("check_tensor_parallel", _judge_values, tensor_parallel_mlp, world_sizes, seed, dims, rounds)


def _judge_values(check, rank, got, want, world_size, dims, where):
    batch, d_in, hidden, d_out = dims
    w1, b1, w2, b2 = want["params"]
    blk = _block(hidden, world_size, rank)
    y = got["y"]
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (batch, d_out):
        raise CheckFailed(check, f"the module's forward returned {_describe(y)} ({where})", ranks=[rank],
                          expected=f"the MLP's whole output, a tensor of shape ({batch}, {d_out}), on every rank",
                          hint="the row-parallel layer must sum the ranks' partial outputs, then add the bias: every "
                          "rank ends with the whole output")
    if got["marked"]:  # the marked pass: only whether the results came out of the collectives
        _came_out(check, rank, y, want["y"], got["delivered_forward"], "output", "forward", where)
        if isinstance(got["x_grad"], torch.Tensor):
            _came_out(check, rank, got["x_grad"], want["x_grad"], got["delivered_backward"], "input's gradient",
                      "backward", where)
        return
    if not _close(y, want["y"]):
        partial = want["h"][:, blk] @ w2[:, blk].T
        if bool(torch.isnan(y).any()):
            problem, hint = _NAN
        elif _close(y, want["y"] + (world_size - 1) * b2):
            problem, hint = ("the second layer's bias was added on every rank before the sum: the output holds it "
                             f"{world_size} times", "add the row-parallel layer's bias once, after the all-reduce "
                             "(every rank holds the whole bias), never to the partial outputs")
        elif any(_close(y, partial + c * b2) for c in (0.0, 1.0, 1.0 / world_size)):
            problem, hint = ("the output is this rank's partial output: it was never summed over the ranks",
                             "the row-parallel layer's forward must all-reduce (sum) the partial outputs")
        elif _close(y, (want["y"] - b2) / world_size + b2) or _close(y, want["y"] / world_size):
            problem, hint = (f"the output is the ranks' partial outputs averaged, 1/{world_size} of their sum: the "
                             "all-reduce's result was divided by the world size", _SUM_HINT)
        elif _close(y, want["y_input_summed"].get(world_size, want["y"])):
            problem, hint = ("the output is the MLP's output on world_size x the input: the input was all-reduced in "
                             "forward", "the function that hands the (replicated) input to the column-parallel layer "
                             "is the identity in forward; its all-reduce belongs in backward")
        else:
            problem, hint = ("the output differs from the unsplit MLP's", _SHAPE_HINT)
        raise CheckFailed(check, f"{problem} ({where})", ranks=[rank], expected="the unsplit MLP's output, within 1e-5",
                          got=f"max difference {_diff(y, want['y'])}", hint=hint)
    x_grad = got["x_grad"]
    _judge_input_grad(check, rank, x_grad, want, world_size, blk, where)
    _judge_params(check, rank, got["params"], want, world_size, blk, where)


def _came_out(check, rank, value, want, delivered, what, phase, where) -> None:
    """Fail when ``value`` is right as it stands in a marked pass: what comes out of the phase's collectives there
    carries the ranks' secret numbers on top of what was sent (:func:`graders.common.comm_spy.marker`), so a value
    without them was computed some other way, whether collectives ran beside it (their results left unused) or
    none did (the other ranks' parts moved through files or the job's store)."""
    if _close(value, want):
        how = ("the collective's result was not used" if delivered else
               "no collective delivered it: the other ranks' parts reached this rank another way")
        raise CheckFailed(check, f"the {what} is right, but it did not come out of the {phase}'s collective ({where})",
                          ranks=[rank], expected=f"the {what} made of what the {phase}'s all-reduce returned",
                          got=f"the {what} computed another way: {how}",
                          hint="use the result of the all-reduce: a collective whose result is thrown away while the rank "
                          f"computes the {what} some other way (from files, the job's store, the caller's objects) is "
                          "not tensor parallelism: the other ranks' parts reach a rank only through the sum")


def _judge_input_grad(check, rank, x_grad, want, world_size, blk, where):
    w1 = want["params"][0]
    if x_grad is None:
        raise CheckFailed(check, f"the input got no gradient ({where})", ranks=[rank],
                          expected="x.grad: the unsplit MLP's gradient of the input",
                          hint="the graph must reach the input: your autograd functions' backward must return the "
                          "gradient of their input (do not detach the input)")
    if _close(x_grad, want["x_grad"]):
        return
    partial = want["z_grad"][:, blk] @ w1[blk]
    if isinstance(x_grad, torch.Tensor) and bool(torch.isnan(x_grad).any()):
        problem, hint = _NAN
    elif _close(x_grad, partial):
        problem, hint = ("the input's gradient is only this rank's part: it was never summed over the ranks in "
                         "backward", "every rank uses the whole input for its block of hidden units, so each holds only "
                         "a partial gradient of it: the function that feeds the column-parallel layer must all-reduce "
                         "the gradient in backward (identity forward, all-reduce backward)")
    elif _close(x_grad, want["x_grad"] / world_size):
        problem, hint = (f"the input's gradient is 1/{world_size} of the unsplit one: the backward's all-reduce was "
                         "divided by the world size", _SUM_HINT)
    elif _close(x_grad, want["x_grad"] * world_size, ATOL * world_size):
        problem, hint = (f"the input's gradient is {world_size} x the unsplit one: the gradient was summed over the "
                         "ranks once too often", "all-reduce in one direction only: the row-parallel sum's backward "
                         "is the identity (every rank already holds the whole output's gradient)")
    else:
        problem, hint = "the input's gradient differs from the unsplit MLP's", _SHAPE_HINT
    raise CheckFailed(check, f"{problem} ({where})", ranks=[rank], expected="the unsplit MLP's x.grad, within 1e-5",
                      got=f"max difference {_diff(x_grad, want['x_grad'])}", hint=hint)


def _judge_params(check, rank, params, want, world_size, blk, where):
    w1, b1, w2, b2 = want["params"]
    g1, gb1, g2, gb2 = want["grads"]
    shards = [("the first layer's weight, rows {} (its output features)", w1[blk], g1[blk]),
              ("the first layer's bias, entries {}", b1[blk], gb1[blk]),
              ("the second layer's weight, columns {} (its input features)", w2[:, blk], g2[:, blk]),
              ("the second layer's bias, whole", b2, gb2)]
    span = f"{blk.start}..{blk.stop - 1}"
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v, _ in params]
    used = set()
    for name, value, grad in shards:
        name = name.format(span)
        found = next((i for i, (v, _) in enumerate(params) if i not in used and isinstance(v, torch.Tensor)
                      and v.shape == value.shape and torch.equal(v, value)), None)
        if found is None:
            raise CheckFailed(check, f"rank {rank}'s module holds no parameter equal to its shard of {name} ({where})",
                              ranks=[rank], expected=f"a parameter of shape {tuple(value.shape)} equal to that slice",
                              got=f"parameters of shapes {shapes}", hint=_SHAPE_HINT + f"; rank r keeps block r of "
                              f"the hidden units (here {span}), as torch's ColwiseParallel/RowwiseParallel do")
        used.add(found)
        got = params[found][1]
        if got is None or isinstance(got, str):
            bias_elsewhere = value is b2 and rank > 0
            raise CheckFailed(check, f"{name} got no gradient on rank {rank} ({where})", ranks=[rank],
                              expected="its slice of the unsplit MLP's gradient",
                              hint=("the second bias is replicated: every rank adds its own copy once, after the sum, "
                                    "so every copy gets the whole gradient (a bias added on rank 0 only leaves the "
                                    "other ranks' copies without one, and an optimizer lets the copies drift apart)"
                                    if bias_elsewhere else "use the shard parameters themselves in forward (not "
                                    "copies or .data), so backward reaches them"))
        if not _close(got, grad):
            scaled = _close(got, grad * world_size, ATOL * world_size)
            shared = not scaled and _close(got, grad / world_size)
            hint = ("the output's gradient was summed over the ranks in backward, though every rank already held all of "
                    "it: the row-parallel sum's backward is the identity" if scaled else _SHAPE_HINT)
            if shared:
                hint = ("the second bias is replicated: every rank adds its whole copy once, after the sum (a share of "
                        "it added to each partial output gets a share of the gradient)" if value is b2 else _SUM_HINT)
            raise CheckFailed(check, f"the gradient of {name} differs from the unsplit MLP's ({where})", ranks=[rank],
                              expected="its slice of the unsplit MLP's gradient, within 1e-5", hint=hint,
                              got=(f"{world_size} x that gradient" if scaled else f"1/{world_size} of that gradient"
                                   if shared else f"max difference {_diff(got, grad)}"))
    extra = [shapes[i] for i in range(len(params)) if i not in used]
    if extra:
        raise CheckFailed(check, f"rank {rank}'s module holds more than its shards: {len(extra)} more parameter(s) "
                          f"({where})", ranks=[rank], expected="exactly 4 parameters: its rows of the first weight and "
                          "bias, its columns of the second weight, the second bias",
                          got=f"also parameters of shapes {extra}",
                          hint="keep only the slices (a module that keeps the whole nn.Linear as an attribute keeps "
                          "its whole weight: tensor parallelism is there so that no rank holds it)")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return str(value)


def _diff(a, b) -> str:
    return f"{(a - b).abs().max().item():.3g}" if isinstance(a, torch.Tensor) and a.shape == b.shape else "n/a"


# --- the collectives ---------------------------------------------------------------------------------


def check_tensor_parallel_collectives(tensor_parallel_mlp, *, world_sizes=(2, 3), seed=0, dims=DIMS, rounds=ROUNDS):
    """Each forward runs one all-reduce of the output (this rank's partial output), each backward one of the
    input's gradient (its partial gradient), and nothing else."""
    _judge_every_round("check_tensor_parallel_collectives", _judge_collectives, tensor_parallel_mlp, world_sizes, seed,
                       dims, rounds)


def _judge_collectives(check, rank, got, want, world_size, dims, where):
    batch, d_in, hidden, d_out = dims
    blk = _block(hidden, world_size, rank)
    w1, _, w2, _ = want["params"]
    out_n, in_n = batch * d_out, batch * d_in
    expected = (f"forward: one all-reduce of {out_n} values (the output, {batch}x{d_out}); backward: one all-reduce "
                f"of {in_n} values (the input's gradient, {batch}x{d_in}); nothing else")
    for phase, issued, size in (("forward", got["forward"], out_n), ("backward", got["backward"], in_n)):
        listed = ", ".join(f"{c['op']} of {'+'.join(map(str, c['numels'])) or 0}" for c in issued) or "none"
        if [(c["op"], c["numels"]) for c in issued] == [("all_reduce", [size])]:
            continue
        reduces = [c for c in issued if c["op"] == "all_reduce"]
        others = sorted({c["op"] for c in issued if c["op"] != "all_reduce"})
        if others:
            problem = (f"the {phase} ran {', '.join(others)}: the tensor-parallel MLP needs one all-reduce each way and "
                       "nothing else")
            hint = ("column-parallel then row-parallel needs no communication between the layers: each rank's block "
                    "of hidden units feeds its own columns of the second weight; only the partial outputs are summed")
        elif phase == "forward" and any(c["numels"] == [in_n] for c in reduces):
            problem = "the forward also all-reduced the input: the copy into the column-parallel layer summed it"
            hint = "that function is the identity in forward and all-reduces the gradient in backward"
        elif phase == "backward" and any(c["numels"] == [out_n] for c in reduces):
            problem = ("the backward also all-reduced the output's gradient: the row-parallel sum all-reduces in both "
                       "directions")
            hint = ("every rank already holds the whole output's gradient, so the sum's backward is the identity "
                    "(dividing the result by the world size hides the wrong gradient but not the extra communication)")
        elif not any(c["numels"] == [size] for c in reduces):
            problem = (f"the {phase} ran no all-reduce of the {'output' if phase == 'forward' else 'input gradient'}"
                       + (": the partial outputs were never summed" if phase == "forward"
                          else ": the input's partial gradients were never summed"))
            hint = ("the row-parallel layer's forward sums the partial outputs with one all-reduce" if phase == "forward"
                    else "the function that feeds the column-parallel layer all-reduces the gradient in backward")
        else:
            problem = f"the {phase} ran other collectives than the one all-reduce it needs"
            hint = "one all-reduce in forward (the output) and one in backward (the input's gradient), once each"
        raise CheckFailed(check, f"{problem} ({where})", ranks=[rank], expected=expected,
                          got=f"{phase}: {listed}", hint=hint)
    partial_out = want["h"][:, blk] @ w2[:, blk].T
    partial_in = want["z_grad"][:, blk] @ w1[blk]
    for phase, carried, target, what in (
            ("forward", got["carried_forward"], partial_out, "this rank's partial output (its hidden units times its "
                                                             "columns of the second weight)"),
            ("backward", got["carried_backward"], partial_in, "this rank's partial gradient of the input (the gradient "
                                                              "of its hidden units times its rows of the first weight)")):
        values = [v for r in carried for v in r["values"]]
        if len(carried) != 1 or len(values) != 1 or values[0].numel() != target.numel():
            raise CheckFailed(check, f"the {phase}'s all-reduce was not seen carrying values on this rank's thread "
                              f"({where})", ranks=[rank], expected=f"one all-reduce carrying {what}",
                              got=f"{len(carried)} collective(s) seen carrying values",
                              hint="issue the all-reduce from forward and backward themselves (no other thread)")
        diff = values[0].reshape(target.shape) - target
        if phase == "forward":
            diff = diff - diff[0]  # a bias added before the sum (all of it, or a share) is the values check's concern
        if diff.abs().max().item() > ATOL:
            raise CheckFailed(check, f"the {phase}'s all-reduce did not carry {what} ({where})", ranks=[rank],
                              expected=f"{target.numel()} values equal to {what}",
                              got=f"max difference {diff.abs().max().item():.3g}",
                              hint="all-reduce the tensor you compute, not a copy or zeros; the sum is what every rank "
                              "must use afterwards")
    # what the all-reduces returned (the ranks' carried values, summed in the grader's process, plus the sum of the
    # ranks' secret numbers the marker put on them) must be what the rank used: its output is the forward's sum plus
    # the bias, its x.grad the backward's sum; a result computed another way lacks the numbers
    for phase, result, what in (("forward", got["y"], "output"), ("backward", got["x_grad"], "input's gradient")):
        summed = got[f"summed_{phase}"]
        if summed is None:
            continue  # some rank's all-reduce was not seen carrying values: that rank's own verdict says so
        reduced = got[f"reduced_{phase}"]
        rest = result - summed.reshape(result.shape) - (reduced or 0.0) if isinstance(result, torch.Tensor) and \
            result.numel() == summed.numel() and reduced is not None else None
        if phase == "forward" and rest is not None and (
                not got["marked"] or _close(rest, want["params"][3].expand_as(rest))):
            # the bias, added after the sum, is the same in every row (sent in the sum, 0 here); in the marked pass
            # the rest must be the bias or nothing, so that the secret numbers' sum is not taken for a bias
            rest = rest - rest[0]
        if rest is not None and not bool(rest.abs().max() <= ATOL):
            mean = result - (summed.reshape(result.shape) + reduced) / world_size
            if bool((mean - mean[0] if phase == "forward" else mean).abs().max() <= ATOL):  # (a bias: equal rows)
                raise CheckFailed(check, f"the {what} is what the {phase}'s all-reduce returned divided by the world size "
                                  f"({where})", ranks=[rank], expected=f"the {what} made of the all-reduce's sum as it "
                                  "comes", got=f"1/{world_size} of it", hint=_SUM_HINT)
        if rest is None or not bool(rest.abs().max() <= ATOL):
            raise CheckFailed(check, f"the {what} is not what the {phase}'s all-reduce returned ({where})", ranks=[rank],
                              expected=f"the {what} made of the sum of the values every rank's {phase} all-reduce "
                              "carried" + (" (plus the second bias)" if phase == "forward" else ""),
                              got="another tensor" if rest is None else f"max difference {rest.abs().max().item():.3g}",
                              hint="use the result of the all-reduce: a collective whose result is thrown away while "
                              "the rank computes the " + what + " some other way is not tensor parallelism (each rank "
                              "holds only its own shards: the other ranks' parts reach it only through the sum)")
