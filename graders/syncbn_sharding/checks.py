"""Checks for exercise 3: a synchronised BatchNorm and a sharded checkpoint of ZeRO's optimizer state.

Each check runs the student's function or class on real ranks (gloo, CPU)
through a harness (:mod:`graders.syncbn_sharding.harness`), which returns plain observations; the verdict is
computed here, against single-process references: BatchNorm on the global
batch (in float64), Adam on the global batch. Per-rank data differ in mean, scale and batch
size (one rank may hold one sample, or none), so a missing combination or a local count cannot pass by
accident, and each rank's batch carries a shift drawn in that rank (returned with its observations), so no
rank can rebuild another's batch from the public seeds instead of communicating; values far from zero judge numerical accuracy; the running statistics are read from the very buffer
tensors the layer was built with (updated in place, outside autograd). The memory part's checks are in
:mod:`graders.syncbn_sharding.memory`.

The sharded save of ZeRO's state is judged in :mod:`graders.syncbn_sharding.zero` (its checks are named here too, as the
notebook calls them).
"""

from __future__ import annotations

import os

import torch

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed, stranded
from graders.syncbn_sharding.harness import (
    BIAS,
    BN_STEPS,
    EPS,
    MOMENTUM,
    RUNNING_MEAN,
    RUNNING_VAR,
    SAVE_ROUNDS,
    WEIGHT,
    C,
    _bn_harness,
    _bn_reference,
    _bn_sums,
    _bn_variant,
    _zero_reference,
)
from graders.syncbn_sharding.zero import (
    MOVED_SHARE,
    ZERO_ATOL,
    judge_attribution,
    judge_foreign,
    loaded_state,
    no_shared_file,
    round_of,
    saved_files,
    state_bytes,
    zero_state_diff,
)

BN_RTOL, BN_ATOL = 1e-4, 1e-5  # float32 against the float64 truth, data of mean and spread about 1

#: values around this offset, spread about 1: where float32 sums of squares lose the variance
ACCURACY_OFFSET = 1000.0
#: how far from the float64 truth a float32 BatchNorm may be there: a two-pass float32 BatchNorm of the
#: whole batch is off by about 1e-4 in y (x - mean loses the digits below float32's 6e-5 at 1000); the
#: float32 sums recipe by 1e-2 to 2e-1 (measured in tests/test_graders_ex3.py)
ACCURACY_ATOL = {"y": 2e-3, "running_mean": 1e-5 * ACCURACY_OFFSET, "running_var": 2e-3}



def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=BN_RTOL, atol=BN_ATOL, equal_nan=True)


# =========================================================================== a synchronised BatchNorm on CPU

# (per-rank batch sizes, trailing dims, common offset), one job per world size. Uneven sizes, so counts matter;
# a rank with one sample and a rank with none, as torch's SyncBatchNorm allows (an empty rank still joins the
# collectives, with count 0).
_BN_CASES = {
    2: [((1, 4), (2,), 0.0), ((2, 5), (), 0.0), ((3, 8), (16,), ACCURACY_OFFSET)],
    3: [((2, 5, 3), (), 0.0), ((3, 0, 2), (2, 2), 0.0), ((4, 1, 1), (), 0.0),
        ((1, 7, 0), (16,), ACCURACY_OFFSET), ((5, 2, 9), (16,), ACCURACY_OFFSET)],
}
#: the hidden tests' cases (``hidden=True``): four ranks, other batch sizes and shapes, so other data
_BN_HIDDEN_CASES = {
    4: [((3, 1, 6, 2), (3,), 0.0), ((0, 5, 2, 4), (), 0.0), ((5, 12, 2, 8), (16,), ACCURACY_OFFSET)],
}

_BN_MISTAKES = {
    "local": "the statistics of rank {rank}'s own batch only: the ranks' statistics were never combined",
    "local_count": "the combined sums divided by rank {rank}'s own count: the count is global too",
    "unweighted": "the plain average of the ranks' means and variances: the ranks hold different numbers of "
                  "values, so each rank's statistics must count in proportion to its count",
    "within_only": "the count-weighted average of the ranks' variances alone: the global variance also holds "
                   "the spread of the ranks' means around the global mean, sum n_i (mean_i - mean)^2 / n",
    "biased": "running_var was updated with the biased variance (divided by n): nn.BatchNorm keeps the "
              "unbiased one, var * n / (n - 1), with n the GLOBAL count",
    "unbiased_norm": "the output was normalised with the unbiased variance: normalise with the biased one "
                     "(divided by n), use the unbiased one only for running_var",
    "swapped": "momentum was applied the wrong way round: nn.BatchNorm computes "
               "running = (1 - momentum) * running + momentum * batch_statistic",
    "no_eps": "the output was normalised without the layer's eps (none, or nn.BatchNorm's default 1e-5 written "
              f"in): divide by sqrt(var + self.eps), the layer's own (here {EPS:g})",
}

_HOW = ("combine the ranks' (count, mean, variance) per channel: n = sum n_i, mean = sum n_i mean_i / n, "
        "var = sum n_i (var_i + (mean_i - mean)^2) / n, leaving out ranks with n_i = 0")


def _diagnose(xs, rank, running, key: str, got: torch.Tensor) -> str | None:
    index = {"y": 0, "running_mean": 1, "running_var": 2}[key]
    if bool(torch.isnan(got).any()):
        empty = [r for r, x in enumerate(xs) if x.shape[0] == 0]
        single = [r for r, x in enumerate(xs) if x.numel() == x.shape[1]]
        return ("NaN: " + (f"rank {empty[0]} has no samples, and the mean of nothing is 0/0: give an empty rank "
                           "count 0 and leave its mean and variance out (it must still join the collectives)"
                           if empty else
                           f"rank {single[0]} has one value per channel, whose unbiased variance is 0/0: combine "
                           "biased (divided by n_i) per-rank variances" if single else "a division by zero"))
    for variant, text in _BN_MISTAKES.items():
        if _close(got, _bn_variant(xs, rank, running, variant)[index]):
            return text.format(rank=rank)
    return None


def _run_bn(check: str, bn_cls, accuracy: bool = False, hidden: bool = False):
    """(ws, sizes, tail, offset, observations per rank, reference) for every case: world sizes 2 and 3 (``hidden``:
    the hidden tests' 4); the large-offset cases when ``accuracy``, else the others."""
    checks.require_written(check, CPUSyncBatchNorm=bn_cls)
    mistakes = [
        Mistake(lambda rank, text: "in-place operation" in text,
                "forward changed a tensor in place that autograd tracks, such as its input x (rank {rank})",
                "compute new tensors (y = (x - mean) / ...) instead of changing x or saved tensors in place"),
        Mistake(lambda rank, text: stranded(text),
                "rank {rank} lost its peers inside a collective ({ws}-rank job)",
                "every rank, even one with an empty batch, must call the same collectives in the same order "
                "with the same tensor sizes"),
        Mistake(lambda rank, text: "collective mismatch" in text or "doesn't match expected size" in text,
                "rank {rank} met a collective the others were not in: the ranks called different collectives "
                "({ws}-rank job)",
                "every rank, even one with an empty batch, must call the same collectives in the same order "
                "with the same tensor sizes (a rank that returns early skips the others' exchange)"),
    ]
    for ws, cases in (_BN_HIDDEN_CASES if hidden else _BN_CASES).items():
        job = checks.memo(check, ("bn", bn_cls, ws), lambda ws=ws, cases=cases: checks.run(
            check, _bn_harness, ws, args=(bn_cls, cases), mistakes=mistakes))
        for index, (sizes, tail, offset) in enumerate(cases):
            if (offset > 0) != accuracy:
                continue
            values = [per_case[index] for per_case in job.values]
            for rank, obs in enumerate(values):
                if "error" in obs:
                    raise CheckFailed(check, f"rank {rank}: {obs['error']}", ranks=[rank],
                                      hint="forward must return the normalised tensor, shaped like its input")
            shifts = tuple(float(obs["shift"]) for obs in values)  # each rank's own, drawn in the rank
            yield ws, sizes, tail, offset, values, _bn_reference(sizes, tail, BN_STEPS, offset, shifts)


def _count(sizes, tail) -> int:
    count = sum(sizes)
    for t in tail:
        count *= t
    return count


def _where(ws: int, sizes, tail, offset: float = 0.0) -> str:
    shape = ", ".join(["N", str(C)] + [str(t) for t in tail])
    where = f"{ws} ranks, float32 input ({shape}) with N = {list(sizes)} per rank"
    return where + (f", values around {offset:g}" if offset else "")


def _sanity(reference: list[dict]) -> None:
    """The data must tell the right recipe from the wrong ones, or the check proves nothing."""
    for step in reference:
        xs = step["xs"]
        for rank in range(len(xs)):
            if xs[rank].shape[0] == 0:
                continue  # an empty rank's output is empty: its running statistics are judged on the others
            running = (torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR))
            right = _bn_variant(xs, rank, running, "global")
            for variant in _BN_MISTAKES:
                wrong = _bn_variant(xs, rank, running, variant)
                keys = {"unbiased_norm": (0,), "biased": (2,), "swapped": (1, 2), "within_only": (0, 2),
                        "unweighted": (0, 2), "no_eps": (0,)}.get(variant, (0, 1))
                if any(_close(right[i], wrong[i]) for i in keys):
                    raise AssertionError(f"grader data cannot tell {variant} from right on rank {rank}")


def check_syncbn_output(bn_cls, hidden: bool = False) -> None:
    """In training mode every rank's output is normalised with the GLOBAL batch's mean and variance."""
    check = "check_syncbn_output"
    for ws, sizes, tail, _, values, reference in _run_bn(check, bn_cls, hidden=hidden):
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
                hint=_HOW,
            )
    passed(check)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{float((a.float() - b.float()).abs().max()):.3g}" if a.shape == b.shape and a.numel() else "(shapes differ)"


def check_syncbn_running_stats(bn_cls, hidden: bool = False) -> None:
    """running_mean/running_var follow nn.BatchNorm's update with global statistics (unbiased variance, momentum)."""
    check = "check_syncbn_running_stats"
    for ws, sizes, tail, _, values, reference in _run_bn(check, bn_cls, hidden=hidden):
        for step, ref in enumerate(reference):
            before = ((torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR)) if step == 0 else
                      (reference[step - 1]["running_mean"], reference[step - 1]["running_var"]))
            for rank, obs in enumerate(values):
                for key in ("running_mean", "running_var"):
                    seen = obs["steps"][step]
                    got = seen[key]  # what the layer's own buffer tensor holds: "in place" is judged on it
                    _in_place(check, ws, sizes, tail, step, rank, key, seen, ref[key])
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
                        hint="update the buffers in place without gradient, with the global mean and the "
                        "unbiased global variance (var * n / (n - 1)), n = the global count, on every rank "
                        "(an empty one too)",
                    )
    passed(check)


def _in_place(check: str, ws: int, sizes, tail, step: int, rank: int, key: str, seen: dict, want) -> None:
    """The layer's own ``key`` buffer (the tensor it was built with) holds the statistics, outside autograd."""
    where = f"{_where(ws, sizes, tail)}, forward #{step + 1}"
    hint = (f"update the buffer itself ({key}), in place and outside autograd (under torch.no_grad()): scale it "
            "by (1 - momentum) and add momentum times the batch's statistic")
    replaced = seen.get(f"{key}_replaced")
    if replaced is not None:
        right = replaced.shape == want.shape and _close(replaced, want)
        raise CheckFailed(check, f"{key} was replaced by a new tensor instead of being updated in place ({where})",
                          ranks=[rank], expected=f"the layer's own {key} tensor, changed in place (whatever holds "
                          "it, DDP's buffer broadcast for one, sees the update only then)",
                          got="a new tensor assigned to self." + key + (" (with the right values)" if right else ""),
                          hint=hint)
    if seen.get(f"{key}_graph"):
        raise CheckFailed(check, f"{key} became part of the autograd graph ({where})", ranks=[rank],
                          expected=f"{key} updated without gradient (requires_grad False, no grad_fn)",
                          got="a buffer that requires grad: the statistics were not detached", hint=hint)


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in t.flatten().tolist()[:6]) + "]"


def check_syncbn_backward(bn_cls, hidden: bool = False) -> None:
    """Gradients flow back through the communication: input and weight gradients equal global-batch BatchNorm's."""
    check = "check_syncbn_backward"
    for ws, sizes, tail, _, values, reference in _run_bn(check, bn_cls, hidden=hidden):
        ref = reference[0]
        for rank, obs in enumerate(values):
            got = obs["steps"][0]
            bare = [r for r, o in enumerate(values) if o["steps"][0].get("no_graph")]
            if bare and _close(got["y"], ref["y"][rank]):
                raise CheckFailed(check, f"{checks.rank_list(bare)}'s output has no autograd graph, so no backward ran "
                                  f"({_where(ws, sizes, tail)}): that rank's backward would not join the others' "
                                  "exchange, and they would wait for it forever", ranks=bare,
                                  expected="on every rank, even one with an empty batch, an output computed from the "
                                  "forward's exchange (an empty rank's output: x's empty slice of that computation)",
                                  got=f"rank {bare[0]}'s output does not require grad",
                                  hint="compute every rank's output the same way from the exchanged statistics (an "
                                  "empty batch gives an empty output): a fresh torch.zeros_like(x) has no graph")
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
                if got[key] is None and not ref[key][rank].any():
                    continue  # torch's own SyncBatchNorm returns None on a rank with no samples: "interpreted as zeros"
                if got[key] is None or not _close(got[key], ref[key][rank]):
                    raise CheckFailed(
                        check,
                        f"the {name} gradient differs from BatchNorm on the global batch ({_where(ws, sizes, tail)})",
                        ranks=[rank],
                        expected=f"d(sum of every rank's loss)/d({name}) on this rank, within {BN_ATOL:g}",
                        got="no gradient" if got[key] is None else f"max |diff| {_maxdiff(got[key], ref[key][rank])}",
                        hint="the mean and variance depend on every rank's input, so the gradient must flow "
                        "back through the communication: use the differentiable collectives of "
                        "torch.distributed.nn.functional (all_reduce, all_gather: their backward sends the "
                        "gradients back to every rank), not dist.all_reduce / dist.all_gather, and do not "
                        "detach the statistics",
                    )
    passed(check)


def check_syncbn_accuracy(bn_cls, hidden: bool = False) -> None:
    """float32 inputs far from zero (values around ACCURACY_OFFSET, spread about 1): the output and running
    statistics stay as accurate as one process's float32 BatchNorm, within ACCURACY_ATOL of the float64 truth."""
    check = "check_syncbn_accuracy"
    for ws, sizes, tail, offset, values, reference in _run_bn(check, bn_cls, accuracy=True, hidden=hidden):
        for step, ref in enumerate(reference):
            for rank, obs in enumerate(values):
                got = dict(obs["steps"][step])
                for key in ("running_mean", "running_var"):  # accuracy only: where they are kept is judged elsewhere
                    if got.get(f"{key}_replaced") is not None:
                        got[key] = got[f"{key}_replaced"]
                worst = {key: _error(got[key], ref[key][rank] if key == "y" else ref[key], key)
                         for key in ("y", "running_mean", "running_var")}
                bad = {k: e for k, e in worst.items() if e > ACCURACY_ATOL[k]}
                if not bad:
                    continue
                key = next(iter(bad))
                near_zero = _right_near_zero(bn_cls, key)
                named = ("right on data near zero (check_syncbn_output passes) but not here: precision is lost, "
                         "as when the variance is E[x^2] - E[x]^2 in float32, which subtracts two numbers near "
                         f"{offset ** 2:g} to get one near 1 while float32 keeps only about 7 digits"
                         if near_zero else None)
                if not near_zero and key != "y" and _right_near_zero(bn_cls, "y"):
                    raise CheckFailed(
                        check, f"{key} after forward #{step + 1} is off by {bad[key]:.3g} from the float64 truth "
                        f"({_where(ws, sizes, tail, offset)}), and on data near zero too: not a loss of precision",
                        ranks=[rank], expected=f"within {ACCURACY_ATOL[key]:g} of nn.BatchNorm's update",
                        got="max errors: " + ", ".join(f"{k} {e:.3g}" for k, e in worst.items()),
                        hint="the running statistics' update itself is off: check_syncbn_running_stats names how")
                raise CheckFailed(
                    check,
                    f"{key} after forward #{step + 1} is off by {bad[key]:.3g} from the float64 truth "
                    f"({_where(ws, sizes, tail, offset)})",
                    ranks=[rank],
                    expected=f"within {ACCURACY_ATOL[key]:g} ({'relative' if key == 'running_var' else 'absolute'}),"
                    " as one process's float32 BatchNorm on the whole batch is",
                    got=named or "max errors: " + ", ".join(f"{k} {e:.3g}" for k, e in worst.items()),
                    hint="compute each rank's mean and variance on its own values (two passes, as torch does), then "
                    "combine (count, mean, variance) across ranks; never subtract E[x]^2 from E[x^2]",
                )
    passed(check)


def _error(got: torch.Tensor, want: torch.Tensor, key: str) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not got.numel():
        return 0.0
    diff = (got.double() - want.double()).abs()
    if key == "running_var":
        diff = diff / want.double().abs()
    return float("inf") if bool(torch.isnan(diff).any()) else float(diff.max())


def _right_near_zero(bn_cls, key: str = "y") -> bool:
    """Whether ``key`` (the output, or a running statistic) of the well-scaled cases (the same jobs, already run)
    matches the reference."""
    try:
        return all(_close(obs["steps"][0][key], reference[0][key][rank] if key == "y" else reference[0][key])
                   for _, _, _, _, values, reference in _run_bn("check_syncbn_accuracy", bn_cls)
                   for rank, obs in enumerate(values))
    except CheckFailed:
        return False


def _sums_error(xs, rank: int) -> float | None:
    """The output error lesson 3's float32 sums recipe makes on this rank (None for an empty rank)."""
    if not xs[rank].numel():
        return None
    mean, var = _bn_sums(xs)
    truth = _bn_variant(xs, rank, (torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR)), "global")[0]
    shape = [1, C] + [1] * (xs[rank].dim() - 2)
    w, b = torch.tensor(WEIGHT).view(shape), torch.tensor(BIAS).view(shape)
    y = (xs[rank] - mean.view(shape)) / torch.sqrt(var.view(shape) + EPS) * w + b
    return _error(y, truth, "y")


# =========================================================================== ZeRO: a sharded checkpoint


def check_shard_save(save_shard, load_full_state=None, world_size: int = 3, seed: int = 3) -> None:
    """Each rank writes the share of Adam's state it holds, into the folder, in files no other rank writes; nothing is
    gathered on the way (the collectives of the call move almost nothing), and each rank's files hold what that rank
    holds and only that (judged by saving twice, once with every rank's state changed, and reading the files back:
    with load_full_state, and by the grader itself, which looks in each rank's files for the other ranks' decoys)."""
    check = "check_shard_save"
    checks.require_written(check, save_shard=save_shard)
    folders, values = saved_files(check, save_shard, world_size, seed)
    where = f"({world_size}-rank job)"
    limit = state_bytes(world_size, seed) * MOVED_SHARE
    for name, folder in zip(SAVE_ROUNDS, folders):
        seen = round_of(values, name)
        gathered = [r for r, obs in enumerate(seen) if obs["moved"] > limit]
        if gathered:
            obs = seen[gathered[0]]
            ops = ", ".join(sorted(set(obs["ops"])))
            raise CheckFailed(check, f"the ranks exchanged the optimizer state while saving {where}: a gather, "
                              f"which a sharded checkpoint exists to avoid", ranks=gathered,
                              expected=f"collectives that move at most {limit:,.0f} bytes (1/8 of Adam's whole state) "
                              "during the save: a sharded save communicates nothing or almost nothing",
                              got=f"rank {gathered[0]}'s collectives ({ops}) moved {obs['moved']:,} bytes",
                              hint="do not consolidate: each rank writes what its own local optimizer holds")
        # files left outside ckpt_dir (a temporary file written elsewhere and moved into it is no such file)
        outside = [(r, [w for w in obs.get("left", obs["writes"]) if os.path.dirname(os.path.abspath(w)) != folder])
                   for r, obs in enumerate(seen)]
        outside = [(r, paths) for r, paths in outside if paths]
        expect(not outside, check, f"{checks.rank_list([r for r, _ in outside])} left files outside ckpt_dir {where}",
               ranks=[r for r, _ in outside], expected="every file of the checkpoint directly in ckpt_dir",
               got=f"rank {outside[0][0]} wrote {outside[0][1][0]}" if outside else None,
               hint="build every file name with os.path.join(ckpt_dir, ...)")
        silent = [r for r, obs in enumerate(seen) if not obs["writes"]]
        expect(not silent, check, f"{checks.rank_list(silent)} wrote no file {where}", ranks=silent,
               expected="every rank writes the share of the optimizer state it holds: no other rank has it",
               got=f"rank {silent[0]} wrote nothing" if silent else None,
               hint="under ZeRO only rank r holds rank r's share: every rank must save its own, not only rank 0")
        no_shared_file(check, seen, where)
    checks.require_written(check, load_full_state=load_full_state)  # what the files hold, it reads back
    judge_attribution(check, save_shard, load_full_state, values, world_size, seed)
    judge_foreign(check, folders, values, where)  # the grader reads the files itself: no loader hides a gather
    passed(check)


def check_shard_load(save_shard, load_full_state, world_size: int = 3, seed: int = 3) -> None:
    """The checkpoint the ranks saved, read in one process by load_full_state, is the whole Adam state of
    single-process training on the global batch, and a plain Adam that loads it steps exactly as that one."""
    check = "check_shard_load"
    checks.require_written(check, save_shard=save_shard, load_full_state=load_full_state)
    folders, values = saved_files(check, save_shard, world_size, seed)
    no_shared_file(check, round_of(values, "trained"), f"(a {world_size}-rank job's save)")
    reference, trained, after = _zero_reference(world_size, seed)
    obs = loaded_state(check, save_shard, load_full_state, world_size, seed)[0]
    where = f"(the checkpoint of a {world_size}-rank job)"
    if "error" in obs:
        raise CheckFailed(check, f"torch.optim.Adam(model.parameters()).load_state_dict refused what "
                          f"load_full_state returned {where}", expected="a state dict of the form "
                          "optimizer.state_dict() returns for a plain Adam over model.parameters(): 'state' keyed "
                          "by each parameter's index in model.parameters(), and 'param_groups'", got=obs["error"],
                          hint="compare with torch.optim.Adam(model.parameters()).state_dict() of a fresh model")
    why = zero_state_diff(obs["state"], reference)
    missing = why is not None and why.startswith("no state for parameters")
    expect(why is None, check, f"the loaded state is not single-process Adam's after the same training {where}",
           expected=f"every parameter's Adam state (exp_avg, exp_avg_sq, step) within {ZERO_ATOL:g}, under its "
           "index in model.parameters(), and the same hyperparameters", got=why,
           hint=("every rank's share must reach the loader: files named by rank, all read back; and a rank's local "
                 "optimizer numbers its own parameters from 0, so map each one to its index in model.parameters() "
                 "(the same tensor objects) before merging") if missing else
           "a rank's local optimizer numbers its own parameters from 0: map each one to its index in "
           "model.parameters() (the same tensor objects) before merging")
    if "step_error" in obs:
        raise CheckFailed(check, f"Adam could not step after loading {where}", got=obs["step_error"],
                          hint="keep the state's tensors as Adam saved them (step included)")
    off = [i for i, (got, want) in enumerate(zip(obs["after"], after))
           if not torch.allclose(got, want, rtol=0, atol=ZERO_ATOL)]
    expect(not off, check, f"after loading, one more Adam step moved parameters {off} differently from the "
           f"uninterrupted optimizer {where}", expected="the same update as the optimizer that was saved",
           got=f"parameter {off[0]} differs" if off else None,
           hint="save and restore everything Adam's state holds, and the param_groups' hyperparameters")
    passed(check)

