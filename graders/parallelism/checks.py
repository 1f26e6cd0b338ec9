"""Checks for exercise 1, data vs model parallelism (exercises/ex1-parallelism/parallelism.ipynb).

The student writes three functions; each check runs one of them as real ranks:

* ``shard_batch(batch, rank, world_size)`` -> this rank's rows of ``batch``
  (:func:`check_shards`: disjoint and covering; :func:`check_shard_sizes`: balanced);
* ``average_gradients(model, n_local)`` -> every gradient becomes the whole batch's, in place, though the
  ranks hold different numbers of rows (:func:`check_average_gradients`);
* ``two_stage_step(rank, stage, x, y, hidden_shape)`` -> one forward and backward pass of a model
  split across two ranks with send/recv; returns the loss on rank 1 (:func:`check_two_stage`).

Part 4, tensor parallelism, is :mod:`graders.parallelism.tensor_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed, passed

ATOL = 1e-6


# --- shared data -------------------------------------------------------------------------------


def _rows(n: int, width: int = 3) -> torch.Tensor:
    """A batch whose row i is [width*i, width*i + 1, ...]: every row says which one it is."""
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width)


def _mlp(seed: int, d_in: int = 5, hidden: int = 7, d_out: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def _data(seed: int, n: int, d_in: int = 5, d_out: int = 2):
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, d_in, generator=gen)
    y = torch.randn(n, d_out, generator=gen)
    return x, y


# --- 1. sharding ---------------------------------------------------------------------------------


def _shards_harness(rank, shard_batch, batch_sizes):
    checks.join_job()
    world_size = dist.get_world_size()
    out = []
    for n in batch_sizes:
        shard = shard_batch(_rows(n), rank, world_size)
        out.append(checks.to_cpu(shard) if isinstance(shard, torch.Tensor) else f"<{type(shard).__name__}>")
    return out


def _collect_shards(check, shard_batch, world_sizes, batch_sizes):
    """{(world_size, n): [shard of rank 0, shard of rank 1, ...]}, shards validated as rows of the batch."""
    checks.require_written(check, shard_batch=shard_batch)
    hints = [("rank < size", "use the world_size argument; do not hard-code the number of ranks"),
             ("IndexError", "there must be exactly world_size shards, even when the batch does not divide "
                            "evenly (tensor.chunk can return fewer pieces than asked for)")]
    found = {}
    for world_size in world_sizes:
        job = checks.run(check, _shards_harness, world_size, args=(shard_batch, list(batch_sizes)), hints=hints)
        for i, n in enumerate(batch_sizes):
            shards = [job.values[rank][i] for rank in range(world_size)]
            for rank, shard in enumerate(shards):
                _validate_rows(check, shard, rank, world_size, n)
            found[(world_size, n)] = shards
    return found


def _validate_rows(check, shard, rank, world_size, n):
    batch = _rows(n)
    where = f"(batch of {n} rows, world_size={world_size})"
    if not isinstance(shard, torch.Tensor):
        raise CheckFailed(check, f"shard_batch returned {shard} instead of a tensor {where}", ranks=[rank],
                          expected="a tensor holding some rows of `batch`, e.g. batch[start:end]")
    if shard.dim() != 2 or shard.shape[1] != batch.shape[1]:
        raise CheckFailed(check, f"the shard has shape {tuple(shard.shape)} {where}", ranks=[rank],
                          expected=f"whole rows of the batch: shape (k, {batch.shape[1]})",
                          hint="slice the rows (the first dimension), not the columns")
    for row in shard:
        i = int(row[0].item()) // batch.shape[1]
        if not (0 <= i < n and torch.equal(row, batch[i])):
            raise CheckFailed(check, f"the shard holds a row that is not a row of the batch {where}", ranks=[rank],
                              got=row.tolist(), hint="return rows of `batch` unchanged")


def _rank_of_rows(shards):
    owners: dict[int, list[int]] = {}
    for rank, shard in enumerate(shards):
        for row in shard:
            owners.setdefault(int(row[0].item()) // shard.shape[1], []).append(rank)
    return owners


def check_shards(shard_batch, *, world_sizes=(2, 3), batch_sizes=(12, 10, 7)):
    """Every row of the global batch is on exactly one rank (disjoint and covering), for every world size."""
    check = "check_shards"
    found = _collect_shards(check, shard_batch, world_sizes, batch_sizes)
    for (world_size, n), shards in found.items():
        owners = _rank_of_rows(shards)
        where = f"batch of {n} rows, world_size={world_size}"
        shared = {i: r for i, r in owners.items() if len(r) > 1}
        if shared:
            i, ranks = sorted(shared.items())[0]
            raise CheckFailed(
                check, f"shards overlap: {len(shared)} row(s) are on more than one rank ({where}); "
                f"e.g. row {i} is on {checks.rank_list(ranks)}", ranks=sorted({r for rs in shared.values() for r in rs}),
                expected="each row on exactly one rank",
                got=f"shard sizes {[len(s) for s in shards]}, rows per rank {[_ids(s) for s in shards]}",
                hint=("the same row on two ranks and no row missing: padding, as DistributedSampler pads a batch "
                      "that does not divide evenly (repeating rows so every rank gets as many); here the shards may "
                      "differ in size by one, and each row is on one rank only" if len(owners) == n else
                      "rank r's shard must start where rank r-1's ends: start = sum of the sizes of the earlier "
                      "shards"),
            )
        missing = sorted(set(range(n)) - set(owners))
        if missing:
            remainder = n % world_size
            hint = (f"{n} rows over {world_size} ranks leaves a remainder of {remainder}: those rows must go to "
                    "some rank too (give the first `remainder` ranks one extra row each)"
                    if remainder and len(missing) <= remainder else
                    "together the shards must cover every row of the batch")
            raise CheckFailed(
                check, f"{len(missing)} row(s) of the batch are on no rank ({where})",
                expected=f"rows 0..{n - 1}, each on one rank", got=f"rows {missing} missing", hint=hint,
            )
    passed(check)


def _ids(shard):
    return [int(row[0].item()) // shard.shape[1] for row in shard]


def check_shard_sizes(shard_batch, *, world_sizes=(3, 4), batch_sizes=(10, 13)):
    """Shard sizes differ by at most one row, so every rank's mean counts the same (averaging stays exact)."""
    check = "check_shard_sizes"
    found = _collect_shards(check, shard_batch, world_sizes, batch_sizes)
    for (world_size, n), shards in found.items():
        sizes = [len(s) for s in shards]
        if max(sizes) - min(sizes) > 1:
            small = [r for r, s in enumerate(sizes) if s == min(sizes)]
            raise CheckFailed(
                check, f"unbalanced shards for a batch of {n} rows on {world_size} ranks", ranks=small,
                expected=f"sizes that differ by at most one, e.g. {_balanced(n, world_size)}", got=f"sizes {sizes}",
                hint="spread the remainder one row per rank: the average of the ranks' mean gradients equals the "
                "full-batch gradient only when every rank's mean counts (about) the same number of rows",
            )
    passed(check)


def _balanced(n, world_size):
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


# --- 2. averaging gradients over unequal shards ----------------------------------------------------


def _local_batch(seed, n, rank, world_size):
    """This rank's rows of the global batch (balanced, first ranks one more): made here and returned alone, so
    no frame of the rank's process ever holds the other ranks' rows."""
    x, y = _data(seed, n)
    return x.tensor_split(world_size)[rank].clone(), y.tensor_split(world_size)[rank].clone()


def _average_harness(rank, average_gradients, seed, n):
    dev = checks.join_job()
    world_size = checks.REAL.get_world_size()
    model = _mlp(seed).to(dev)
    x_local, y_local = (t.to(dev) for t in _local_batch(seed, n, rank, world_size))
    F.mse_loss(model(x_local), y_local).backward()
    local = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    average_gradients(model, len(x_local))
    after = {name: (None if p.grad is None else p.grad) for name, p in model.named_parameters()}
    return checks.to_cpu({"local": local, "after": after, "rows": len(x_local)})


@checks.reference
def _full_gradients(seed, n):
    model = _mlp(seed)
    x, y = _data(seed, n)
    F.mse_loss(model(x), y).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _close(a, b, atol=ATOL):
    return all(a[k] is not None and torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in b)


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _scale(after, full):
    """The c for which after ~= c * full (least squares)."""
    num = sum((after[k] * full[k]).sum().item() for k in full)
    den = sum((full[k] * full[k]).sum().item() for k in full)
    return num / den if den else float("nan")


def check_average_gradients(average_gradients, *, world_sizes=(2, 3), seed=0, n=11):
    """After average_gradients, every rank holds the gradient of the whole batch, exactly, though the ranks hold
    different numbers of rows."""
    check = "check_average_gradients"
    checks.require_written(check, average_gradients=average_gradients)
    hints = [("timeout", "every rank must run the same collectives, in the same order, with tensors of the same "
                         "shape; check your loop ends and no rank skips a parameter")]
    for world_size in world_sizes:
        if n % world_size == 0:
            raise ValueError(f"n={n} divides by world_size={world_size}: the shards must be unequal")
        full = _full_gradients(seed, n)
        job = checks.run(check, _average_harness, world_size, args=(average_gradients, seed, n), hints=hints)
        locals_ = [obs["local"] for obs in job.values]
        rows = [obs["rows"] for obs in job.values]
        for rank, obs in enumerate(job.values):
            local, after = obs["local"], obs["after"]
            if _close(local, full):  # cannot happen with these shards; guards the check itself
                raise RuntimeError("check_average_gradients: local and full-batch gradients coincide")
            empty = [k for k, g in after.items() if g is None]
            if empty:
                raise CheckFailed(check, f"parameters {empty} have no gradient after average_gradients "
                                  f"(world_size={world_size})", ranks=[rank],
                                  hint="change p.grad in place; do not set it to None")
            if _close(after, full):
                continue
            _explain_gradients(check, rank, world_size, rows, local, locals_, after, full)
    passed(check)


def _explain_gradients(check, rank, world_size, rows, local, locals_, after, full):
    n = sum(rows)
    where = f"world_size={world_size}, {n} rows split {rows}"
    expected = "the gradient of the mean loss over the whole batch, within 1e-6"
    plain = {k: sum(g[k] for g in locals_) / world_size for k in full}
    summed = {k: sum(g[k] for g in locals_) for k in full}
    weighted_sum = {k: sum(r * g[k] for r, g in zip(rows, locals_)) for k in full}
    if _close(after, local):
        raise CheckFailed(check, f"the gradients are unchanged: still this rank's own gradient ({where})",
                          ranks=[rank], expected=expected, got=f"max difference {_max_diff(after, full):.3g}",
                          hint="every rank needs the other ranks' contributions: that takes collectives")
    if _close(after, plain):
        raise CheckFailed(check, f"the gradients are the plain mean of the ranks' gradients, which weighs every rank "
                          f"the same though their shards hold {rows} rows ({where})", ranks=[rank], expected=expected,
                          got=f"max difference {_max_diff(after, full):.3g}",
                          hint="a rank's gradient is the mean over ITS rows: weigh each rank by its number of rows, "
                          "and divide by the number of rows of the whole batch (which no rank knows alone)")
    if _close(after, summed, ATOL * world_size):
        raise CheckFailed(check, f"the gradients are the SUM of the ranks' gradients ({where})", ranks=[rank],
                          expected=expected, got=f"about {world_size} x the full-batch gradient",
                          hint="a sum over ranks needs a division: weigh each rank by its rows, then divide by the "
                          "total number of rows")
    if _close(after, weighted_sum, ATOL * n):
        raise CheckFailed(check, f"the gradients are the row-weighted SUM: {n} x the full-batch gradient ({where})",
                          ranks=[rank], expected=expected, got=f"{n} x the full-batch gradient",
                          hint="divide the row-weighted sum by the total number of rows")
    if _close(after, {k: v / world_size for k, v in local.items()}):
        raise CheckFailed(check, f"the gradients are this rank's own gradient divided by world_size: "
                          f"they were never all-reduced ({where})", ranks=[rank], expected=expected,
                          hint="all-reduce the gradients (summed over the ranks) before dividing")
    scale = _scale(after, full)
    if scale == scale and _close(after, {k: v * scale for k, v in full.items()}, atol=ATOL * max(1.0, abs(scale))):
        raise CheckFailed(check, f"the gradients are {scale:.3g} x the full-batch gradient ({where})", ranks=[rank],
                          expected=expected, got=f"{scale:.3g} x the full-batch gradient",
                          hint=f"the divisor must be the number of rows of the whole batch (here {n}), found with a "
                          "collective, never hard-coded")
    raise CheckFailed(check, f"the averaged gradients differ from the full-batch gradient ({where})", ranks=[rank],
                      expected=expected, got=f"max difference {_max_diff(after, full):.3g}",
                      hint="every parameter's gradient must become sum over ranks (rows_r x gradient_r) / total rows; "
                      "change nothing else")


# --- 3. model parallelism: two stages ------------------------------------------------------------


def _two_stage_harness(rank, two_stage_step, seed, dims):
    dev = checks.join_job()
    n, d_in, hidden, d_out = dims
    model = _mlp(seed, d_in, hidden, d_out)
    stage = (model[:2] if rank == 0 else model[2:]).to(dev)  # rank 0: Linear+Tanh, rank 1: Linear
    x, y = _data(seed, n, d_in, d_out)
    out = two_stage_step(rank, stage, x.to(dev) if rank == 0 else None, y.to(dev) if rank == 1 else None,
                         (n, hidden))
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().reshape(-1)[0].item() if out.numel() == 1 else f"<tensor of shape {tuple(out.shape)}>"
    elif out is not None and not isinstance(out, (int, float)):
        out = f"<{type(out).__name__}>"
    grads = {name: (None if p.grad is None else p.grad) for name, p in stage.named_parameters()}
    return {"loss": out, "grads": checks.to_cpu(grads)}


def _full_model(seed, dims):
    n, d_in, hidden, d_out = dims
    model = _mlp(seed, d_in, hidden, d_out)
    x, y = _data(seed, n, d_in, d_out)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check_two_stage(two_stage_step, *, seed=0, dims=((8, 5, 7, 2),)):
    """One step of a model split over two ranks gives the single model's loss and gradients.

    ``dims`` are (batch, d_in, hidden, d_out) triples to try; the job always has 2 ranks (2 stages).
    """
    check = "check_two_stage"
    checks.require_written(check, two_stage_step=two_stage_step)
    hints = [
        ("timeout", "send and recv must pair up: rank 0 first SENDS its activations, then receives their "
                    "gradient; rank 1 first RECEIVES the activations, then sends the gradient back. If both "
                    "ranks start with recv (or both with send to a rank that is not receiving), both wait forever"),
        ("does not require grad and does not have a grad_fn",
         "backward was called on a detached tensor (rank 0's: keep stage 0's output attached, send out.detach() but "
         "call out.backward(grad) on the original output)"),
        ("One of the differentiated Tensors does not require grad",
         "torch.autograd.grad was asked for the gradient of a tensor that does not require it: on rank 1, call "
         "requires_grad_() on the received activations before stage 1 runs"),
        ("NoneType", "rank 1's received activations need requires_grad_() before stage 1 runs, so that "
                     "act.grad exists after backward from the loss and can be sent back"),
    ]
    for dim in dims:
        dim = tuple(dim)
        loss, full = _full_model(seed, dim)
        job = checks.run(check, _two_stage_harness, 2, args=(two_stage_step, seed, dim), hints=hints)
        first, last = job.values
        where = f"batch {dim[0]}, hidden size {dim[2]}"
        got = last["loss"]
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise CheckFailed(check, f"rank 1 returned {got!r} instead of the loss ({where})", ranks=[1],
                              expected="the loss on rank 1 (a number or a one-element tensor)",
                              hint="return the loss computed on the last stage")
        if abs(got - loss) > ATOL:
            raise CheckFailed(check, f"the loss on rank 1 differs from the single model's ({where})", ranks=[1],
                              expected=f"{loss:.6f} (mse_loss of the whole model on the batch)", got=f"{got:.6f}",
                              hint="rank 1 must run its stage on exactly the activations rank 0 sent, then "
                              "F.mse_loss(output, y)")
        for rank, obs in ((1, last), (0, first)):
            grads = obs["grads"]
            empty = [k for k, g in grads.items() if g is None]
            if empty:
                hint = ("rank 1 must run backward from its loss" if rank == 1 else
                        "rank 0 must receive the gradient of its activations from rank 1 and call "
                        "out.backward(grad) on its (not detached) stage output")
                raise CheckFailed(check, f"stage {rank} has no gradients after the step ({where})", ranks=[rank],
                                  expected="gradients for every parameter of the stage", got=f"{empty} are None",
                                  hint=hint)
            if not _close(grads, {k: full[k] for k in grads}):
                hint = ("rank 1 must send back act.grad, the gradient of the activations it received" if rank == 0
                        else "run backward once, from the loss of this batch")
                raise CheckFailed(check, f"stage {rank}'s gradients differ from the single model's ({where})",
                                  ranks=[rank], expected="the same gradients as the unsplit model, within 1e-6",
                                  got=f"max difference {_max_diff(grads, {k: full[k] for k in grads}):.3g}", hint=hint)
    passed(check)
