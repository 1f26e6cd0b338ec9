"""Checks for exercise 3's memory part: predict what ZeRO and FSDP2 keep on each rank, judged by measuring it.

The student writes a function that, given a model and a world size, returns per rank the bytes of
parameters, gradients and optimizer state. The check runs the real thing on that many ranks (DDP with
``ZeroRedundancyOptimizer`` over Adam; FSDP2 ``fully_shard`` with Adam), trains one step, and counts what each
rank really holds: ``nbytes`` of every parameter, gradient and optimizer-state tensor, and of a DTensor's
local shard. Only then, in rank 0, is the student's function called (so it cannot change what was measured);
its answer must equal the measurement exactly. A prediction must not measure: rank 0 calls it under a seccomp
filter that forbids starting processes (no subprocess can run the job) and changing its limits, and the job's own
process group must still be the default one afterwards (a prediction that destroyed it to simulate the ranks with
torch's fake process group is named). Then it asks about hundreds of other models and world sizes, drawn from
os.urandom for every check (no table covers them), judged by :func:`rule` (the rules the measurement shows, held
to torch by the tests), all the predictions within :data:`PREDICT_CPU_S` of CPU time (the kernel's RLIMIT_CPU):
arithmetic on shapes needs hundredths of that, a simulation of every rank (torch's fake process group, c10d's
tables put back afterwards) far more, and is killed. The answer may not call the grader's own rule either: in
rank 0 every copy of it refuses (:func:`course.checks.refuse`: imported, copied by value, rebuilt from its code
or its source exec'd; issue 37). Wrong answers are recognised by recomputing the usual wrong
models of sharding (an even split, padded shards, a forgotten step counter, ...) and named.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course import checks
from course.checks import CheckFailed, passed, seal
from course.costmodel import fsdp_padded_numel, fsdp_shard_rows
from graders.syncbn_sharding.harness import _init_pg

KEYS = ("params", "grads", "optimizer")
LR = 1e-3


def memory_model(vocab: int = 11, widths: tuple[int, ...] = (6, 5, 7), seed: int = 0) -> nn.Module:
    """The model whose memory is predicted: an embedding, then Linear layers with a LayerNorm between them."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(vocab, widths[0])]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.LayerNorm(b), nn.ReLU()]
    return nn.Sequential(*layers)


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, vocab, (6,), generator=g)


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (a DTensor counts its local shard)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local(value).nbytes
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


#: CPU seconds rank 0 may spend on all its predictions (one per model: the measured one, then :func:`_others`).
#: Arithmetic on the shapes takes milliseconds for all of them (on our 2-core test machine: the reference rule
#: 0.03 s for ZeRO's 600 models, the slowest right answer the tests know, torch.chunk of meta tensors for every
#: rank, 0.17 s for FSDP2's 120); building the sharded model and stepping it for every rank with torch's fake
#: process group costs 6.5 ms of CPU a ZeRO rank and 20 ms an FSDP2 one there: about 74 s and 42 s for all of them
PREDICT_CPU_S = 3
#: how many models and world sizes (12 to 24 ranks) the check asks about besides the one it measures
OTHERS = {"zero": 600, "fsdp": 120}


def _limit_cpu(seconds: int) -> None:
    """End this process (SIGKILL) once it has used ``seconds`` more of CPU time (whole seconds, the kernel's)."""
    import math
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    limit = math.ceil(used.ru_utime + used.ru_stime) + seconds
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))  # soft = hard: SIGKILL, which nothing can catch


def _memory_harness(rank: int, kind: str, predict, world_size: int, vocab: int, widths: tuple, seed: int,
                    others: tuple = ()) -> dict:
    """Measure what this rank holds after one Adam step under ``kind`` ("zero" or "fsdp"); then, on rank 0
    only, ask the student's ``predict`` (after the measurement: nothing it does can change it), in a process that
    can no longer start processes (:func:`course.checks.seal`); afterwards the job's own process group must still be
    the default one (a prediction that destroyed it to simulate the ranks with torch's fake process group left it
    gone)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _init_pg()
    group, world = dist.group.WORLD, c10d._world  # the job's own, taken before any student code runs
    model = memory_model(vocab, widths, seed)
    if kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model)
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
        ddp_model(_tokens(rank, vocab)).square().mean().backward()
        optimizer.step()
        held = optimizer.optim  # this rank's own Adam, over its shard of the parameters
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        held = optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        model(_tokens(rank, vocab)).square().mean().backward()
        optimizer.step()
    measured = {"params": sum(_local(p).nbytes for p in model.parameters()),
                "grads": sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None),
                "optimizer": _state_bytes(held)}
    dist.barrier()
    obs = {"measured": measured}
    if rank == 0:
        asked = [(memory_model(vocab, widths, seed), world_size)] + [
            (memory_model(v, w, 0), ws) for v, w, ws in others]
        _limit_cpu(PREDICT_CPU_S)
        # the grader's rule for the models it does not run (and the cost model's sharding arithmetic) refuse here,
        # wherever the student's code holds or copies them: the answer is the student's own arithmetic
        checks.refuse(_reference_code(), REFUSED)
        try:  # no new process from here on (where the platform can say so: see course.checks.seal)
            obs["sandbox"] = None if seal() else "no seccomp filter on this platform"
        except OSError as err:
            obs["sandbox"] = str(err)
        answers = []
        for model_asked, ws in asked:
            try:
                answers.append(_plain(predict(model_asked, ws)))
            except Exception as exc:  # noqa: BLE001 - shown to the student
                answers.append(None)
                obs["error"] = f"{type(exc).__name__}: {exc}"
                break
        obs["predicted"], obs["others"] = (answers[0] if answers else None), answers[1:]
        obs["group_kept"] = world.default_pg is group and group in world.pg_map
    return obs


def _others(n: int) -> tuple:
    """``n`` (vocab, widths, world size) the check asks predictions for besides the one it measures, drawn anew for
    every check from os.urandom: no table covers them, and simulating each one's ranks costs far more CPU time than
    a rank gets for its predictions (:data:`PREDICT_CPU_S`)."""
    import os
    import random

    draw = random.Random(os.urandom(8))
    return tuple((draw.randint(3, 40), tuple(draw.randint(1, 20) for _ in range(draw.randint(2, 4))),
                  draw.randint(12, 24)) for _ in range(n))


#: what a call of the grader's rule (or a copy of it) raises in the predicting rank
REFUSED = ("graders.syncbn_sharding.memory's rule is the grader's reference, refused to the answer: predict the "
           "bytes from the parameters' shapes and the sharding rules yourself")


def _reference_code() -> list:
    """The grader's own arithmetic for the models it does not run: what the prediction may not call."""
    return [rule, _zero_variant, _fsdp_variant, _zero_assignment, _rows, fsdp_shard_rows, fsdp_padded_numel]


def rule(kind: str, shapes, world_size: int) -> list[dict]:
    """What each rank holds by the rules the check measured (ZeroRedundancyOptimizer's greedy assignment, FSDP2's
    torch.chunk rows, Adam's two moments and float32 step): the truth for the models it does not run
    (tests/test_graders_ex3.py runs some, to hold this to what torch does)."""
    return _zero_variant(shapes, world_size, "greedy") if kind == "zero" else _fsdp_variant(shapes, world_size, "right")


def _plain(value):
    """The prediction as plain Python numbers, made in the rank: the grader never unpickles the student's objects."""
    if isinstance(value, (list, tuple)) and all(isinstance(d, dict) for d in value):
        try:
            return [{k: float(d[k]) for k in KEYS if k in d} for d in value]
        except (TypeError, ValueError, RuntimeError):
            pass
    return repr(value)[:300]


# =========================================================================== what the usual wrong models give


def _shapes(vocab: int, widths: tuple, seed: int) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in memory_model(vocab, widths, seed).parameters()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _zero_assignment(sizes: list[int], ws: int, order: str) -> list[list[int]]:
    """Parameter indices per rank: "greedy" (largest first, each to the rank with the fewest elements so far:
    ZeroRedundancyOptimizer's rule), "round_robin" (i % ws) or "in_order" (greedy, but in model order)."""
    ranks: list[list[int]] = [[] for _ in range(ws)]
    load = [0] * ws
    indices = list(range(len(sizes)))
    if order == "greedy":
        indices.sort(key=lambda i: sizes[i], reverse=True)
    for j, i in enumerate(indices):
        r = j % ws if order == "round_robin" else load.index(min(load))
        ranks[r].append(i)
        load[r] += sizes[i]
    return ranks


def _zero_variant(shapes, ws: int, variant: str) -> list[dict]:
    sizes = [_numel(s) for s in shapes]
    full = 4 * sum(sizes)
    step = 0 if variant == "no_step" else 4
    if variant == "even":
        per = (8 * sum(sizes) + step * len(sizes)) // ws
        return [{"params": full, "grads": full, "optimizer": per} for _ in range(ws)]
    order = variant if variant in ("round_robin", "in_order") else "greedy"
    out = []
    for mine in _zero_assignment(sizes, ws, order):
        state = sum(8 * sizes[i] + step for i in mine)
        params = full // ws if variant == "sharded_params" else full
        out.append({"params": params, "grads": params, "optimizer": state})
    return out


def _rows(d0: int, ws: int, rank: int, variant: str) -> int:
    """Rows of a dim-0 shard: torch.chunk's split (ceil(d0 / ws) each, the last ranks fewer or none)."""
    if variant == "padded":
        return -(-d0 // ws)
    if variant == "even":
        return d0 // ws + (1 if rank < d0 % ws else 0)  # an even split: sizes differ by at most one
    return fsdp_shard_rows(d0, ws, rank)


def _fsdp_variant(shapes, ws: int, variant: str) -> list[dict]:
    out = []
    step = 0 if variant == "no_step" else 4
    for rank in range(ws):
        local = [_rows(s[0], ws, rank, variant) * _numel(s[1:]) for s in shapes]
        params = 4 * sum(local)
        grads = 4 * sum(_numel(s) for s in shapes) if variant == "full_grads" else params
        out.append({"params": params, "grads": grads, "optimizer": 2 * params + step * len(shapes)})
    return out


_ZERO_MISTAKES = {
    "even": "the optimizer state split evenly over the ranks: ZeroRedundancyOptimizer never splits a tensor, it "
            "gives each parameter's whole state to one rank",
    "no_step": "Adam's state without its step counter: every parameter's state also holds `step`, a float32 "
               "scalar tensor (4 bytes)",
    "round_robin": "parameters dealt to the ranks in turn (i % world_size): ZeroRedundancyOptimizer takes them "
                   "largest first, each to the rank that holds the fewest elements so far",
    "in_order": "parameters taken in the model's order: ZeroRedundancyOptimizer sorts them, largest first, "
                "before giving each to the rank that holds the fewest elements so far",
    "sharded_params": "parameters and gradients divided by the world size: ZeRO stage 1 (this optimizer) shards "
                      "only the optimizer state; every rank keeps every parameter and gradient",
}
_FSDP_MISTAKES = {
    "even": "rows split as evenly as possible: FSDP2 splits dim 0 the way torch.chunk does, ceil(rows / "
            "world_size) rows per rank, so the LAST ranks get fewer rows, or none",
    "padded": "every rank counted with ceil(rows / world_size) rows: FSDP2 pads only inside its all-gather, the "
              "local shard (DTensor.to_local()) holds just the rows that are really this rank's",
    "no_step": "Adam's state without its step counter: every parameter's state also holds `step`, a float32 "
               "scalar tensor (4 bytes), on every rank, even one whose shard is empty",
    "full_grads": "full gradients on every rank: FSDP2 reduce-scatters the gradients, each rank keeps its "
                  "shard's gradient only",
}


# =========================================================================== the verdict


def _valid(check: str, predicted, ws: int, name: str) -> list[dict]:
    shape = f"a list of {ws} dicts (one per rank), each {{'params': int, 'grads': int, 'optimizer': int}} in bytes"
    ok = isinstance(predicted, (list, tuple)) and len(predicted) == ws and all(
        isinstance(d, dict) and set(KEYS) <= set(d) for d in predicted)
    if ok:
        try:
            rows = [{k: int(d[k]) for k in KEYS} for d in predicted]
            if all(float(d[k]) == rows[i][k] for i, d in enumerate(predicted) for k in KEYS):
                return rows
        except (TypeError, ValueError, OverflowError):
            pass
    got = predicted if isinstance(predicted, str) else repr(predicted)
    raise CheckFailed(check, f"{name}(model, {ws}) did not return one dict of whole byte counts per rank",
                      ranks=[0], expected=shape, got=got[:300],
                      hint="return [{'params': ..., 'grads': ..., 'optimizer': ...} for each rank]")


def _check_memory(check: str, kind: str, predict, name: str, world_size: int, vocab: int, widths: tuple,
                  seed: int) -> None:
    checks.require_written(check, **{name: predict})
    widths = tuple(widths)
    others = _others(OTHERS[kind])
    killed = checks.Mistake(
        lambda rank, text: rank == 0 and "killed by SIGKILL" in text,
        f"rank 0 was killed while {name} ran: it used up the CPU time the check gives all its predictions "
        f"({PREDICT_CPU_S} s for {1 + len(others)} models and world sizes of up to 24 ranks)",
        "predict from the shapes (p.shape, p.numel(), p.element_size()) and the sharding rules: a prediction is "
        "arithmetic; building the sharded model and stepping it for every rank (torch's fake process group) is "
        "running it")

    def job():
        return others, checks.run(check, _memory_harness, world_size, mistakes=[killed],
                                  args=(kind, predict, world_size, vocab, widths, seed, others))

    others, job = checks.memo(check, ("memory", kind, predict, world_size, vocab, widths, seed), job)
    where = f"{world_size} ranks, float32 parameters shaped {_shapes(vocab, widths, seed)}"
    if not job.values[0].get("group_kept", True):
        raise CheckFailed(check, f"while {name} ran on rank 0, rank 0 left the job's process group ({where})",
                          ranks=[0],
                          expected=f"{name} computes from the model's parameter shapes, without process groups (a "
                          "prediction is made before any job exists)",
                          got="the job's process group was destroyed or replaced during the prediction (torch's fake "
                          "process group to simulate the ranks?)",
                          hint="predict from the shapes: p.numel(), p.element_size(), and the sharding rules")
    error = job.values[0].get("error") or ""
    if "Operation not permitted" in error or "[Errno 1]" in error:
        raise CheckFailed(check, f"{name} tried to start a process ({where})", ranks=[0],
                          expected=f"{name} computes from the model's parameter shapes; it is called in a process "
                          "that may not start others (a prediction runs nothing)", got=error[:300],
                          hint="predict from the shapes: p.numel(), p.element_size(), and the sharding rules")
    if "error" in job.values[0]:
        raise CheckFailed(check, f"{name} raised {job.values[0]['error']} ({where})", ranks=[0],
                          hint="compute from the parameters' shapes (p.shape, p.numel(), p.element_size())")
    predicted = _valid(check, job.values[0]["predicted"], world_size, name)
    measured = [obs["measured"] for obs in job.values]
    shapes = _shapes(vocab, widths, seed)
    variants, mistakes = ((_zero_variant, _ZERO_MISTAKES) if kind == "zero" else (_fsdp_variant, _FSDP_MISTAKES))
    if predicted == measured:
        _judge_others(check, kind, name, others, job.values[0]["others"], variants, mistakes)
        passed(check)
        return
    known = [text for variant, text in mistakes.items() if variants(shapes, world_size, variant) == predicted]
    wrong = [(r, k) for r in range(world_size) for k in KEYS if predicted[r][k] != measured[r][k]]
    rank, key = wrong[0]
    what = "ZeroRedundancyOptimizer(Adam) under DDP" if kind == "zero" else "FSDP2 fully_shard with Adam"
    raise CheckFailed(
        check, f"the predicted {key} bytes differ from what {what} really held after one step ({where})",
        ranks=sorted({r for r, _ in wrong}),
        expected=f"rank {rank}: {measured[rank][key]} bytes of {key} (measured: "
        + ", ".join(f"rank {r} {measured[r]}" for r in range(world_size)) + ")",
        got=f"rank {rank}: {predicted[rank][key]}" + (f": {known[0]}" if known else ""),
        hint="look at one rank's real objects after a step (the parameters, their gradients, the optimizer's "
        "state, a DTensor's local shard) and count every tensor's numel() * element_size()")


def _judge_others(check: str, kind: str, name: str, others: tuple, answers: list, variants, mistakes) -> None:
    """The predictions for the models the check did not run equal what the same rules give (:func:`rule`)."""
    for (vocab, widths, ws), answer in zip(others, answers):
        shapes = _shapes(vocab, widths, 0)
        predicted = _valid(check, answer, ws, name)
        want = rule(kind, shapes, ws)
        if predicted == want:
            continue
        known = [text for variant, text in mistakes.items() if variants(shapes, ws, variant) == predicted]
        wrong = [(r, k) for r in range(ws) for k in KEYS if predicted[r][k] != want[r][k]]
        rank, key = wrong[0]
        raise CheckFailed(
            check, f"right for the model the check measured, but the predicted {key} bytes differ from the same rules "
            f"for another model it asked about ({ws} ranks, float32 parameters shaped {shapes})", ranks=[0],
            expected=f"rank {rank}: {want[rank][key]} bytes of {key}, as the rules give (and torch does)",
            got=f"rank {rank}: {predicted[rank][key]}" + (f": {known[0]}" if known else ""),
            hint="compute from the shapes for any model and world size: every rank holds what the sharding rules "
            "give it, including ranks that get nothing to shard")
    if len(answers) < len(others):
        raise CheckFailed(check, f"{name} gave no answer for some of the models the check asked about", ranks=[0])


def check_zero_memory(predict_zero_bytes, world_size: int = 3, vocab: int = 11, widths=(6, 5, 7),
                      seed: int = 0) -> None:
    """The predicted per-rank bytes under DDP + ZeroRedundancyOptimizer(Adam) equal what each rank holds."""
    _check_memory("check_zero_memory", "zero", predict_zero_bytes, "predict_zero_bytes", world_size, vocab, widths,
                  seed)


def check_fsdp_memory(predict_fsdp_bytes, world_size: int = 3, vocab: int = 11, widths=(6, 5, 7),
                      seed: int = 0) -> None:
    """The predicted per-rank bytes under FSDP2 (fully_shard) with Adam equal what each rank holds."""
    _check_memory("check_fsdp_memory", "fsdp", predict_fsdp_bytes, "predict_fsdp_bytes", world_size, vocab, widths,
                  seed)
