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

import torch

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed, stranded
from graders.ex3_model import (
    BN_STEPS,
    MOMENTUM,
    RUNNING_MEAN,
    RUNNING_VAR,
    ZERO_LR,
    ZERO_STEPS,
    C,
    _bn_harness,
    _bn_reference,
    _bn_variant,
    _convert_harness,
    _zero_model,
    _zero_optimizer_harness,
    _zero_reference,
    _zero_save_harness,
)

BN_RTOL, BN_ATOL = 1e-4, 1e-5  # float32, variance from sums of squares

ZERO_ATOL = 1e-6


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=BN_RTOL, atol=BN_ATOL, equal_nan=True)


# =========================================================================== converting BatchNorms


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
        job = checks.run(check, _zero_save_harness, world_size, args=(save_optimizer, dirs), mistakes=_SAVE_MISTAKES)
        paths = [os.path.join(d, "optimizer.pt") for d in dirs]
        written = {r: job.values[r]["writes"] + [os.path.join(dirs[r], f) for f in os.listdir(dirs[r])]
                   for r in range(1, world_size)}
        others = [r for r, found in written.items() if found]
        expect(not others, check, f"{checks.rank_list(others)} saved a file too ({world_size}-rank job)", ranks=others,
               expected="only rank 0 writes the checkpoint (no other rank writes any file, under any name)",
               got=f"rank {others[0]} wrote {written[others[0]][0]}" if others else None,
               hint="guard the save with `if rank == 0:`")
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

