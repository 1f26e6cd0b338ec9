"""Checks for exercise 3's two-dimensional notebook (exercises/ex3-syncbn-sharding/two_dimensions.ipynb): data and
tensor parallelism at once, on a (dp, tp) mesh of ranks.

The student writes ``train_on_mesh(shard, batches, dp, tp, rank)``: the rank at ``(rank // tp, rank % tp)`` trains
shard ``rank % tp`` of the model (:mod:`graders.two_dimensions.shards`, held by the grader) on its replica's batches,
one SGD step per batch, and returns the replica's loss of each step. A shard's partial output must be summed over
its ``tp`` row, its gradient averaged over its ``dp`` column; each partial output and each replica's gradient exists
in its own rank only, so what the values are says which ranks were combined. One job per mesh; three checks read it
(:func:`course.checks.memo`):

* :func:`check_mesh_losses`: every rank's loss of every step equals its replica's in one process (the model's
  output is the sum of the row's partial outputs);
* :func:`check_mesh_gradients`: the gradient each rank gave its shard's step equals the whole batch's gradient of
  that shard in one process (its column's gradients averaged, nothing counted twice);
* :func:`check_mesh_training`: after every step every copy of every shard equals the one-process model's slice, each
  rank stepped its own shard once a step and nothing else;
* :func:`check_mesh_prediction`: ``predict_mesh(dp, tp, d_in, h, d_out, rows)``, each parameter's placements on the
  mesh as DTensor names them and the values a rank all-reduces in a step along its row and its column, for the asked
  cases and more drawn anew (run in a rank where the grader's answer refuses to run).
"""

from __future__ import annotations

import os
import random

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common import predictions
from graders.common.held import explain
from graders.two_dimensions.shards import STEPS, MeshServer, Shard, batches, draw, fetch_data, reference

ATOL = 1e-5
JOB_TIMEOUT = 90.0
VISIBLE = {"dp": 2, "tp": 2, "d_in": 5, "h": 8, "d_out": 3, "rows": 4, "seed": 0}

_HINTS = [("timeout", "every rank must create every group, in the same order (dist.new_group is a collective of the "
                      "whole world), and run the same collectives on each group in the same order")]


def _harness(rank, train_on_mesh, address, tokens, dp, tp, shape, rows, _shard=Shard):
    checks.join_job()
    shard = _shard(address, tokens[rank], rank, dp, tp, shape)  # connected before the student's code runs
    data = batches(fetch_data(shard), shape[0], rows)  # this replica's batches only, over this rank's connection
    losses = train_on_mesh(shard, data, dp, tp, rank)
    out = []
    for loss in list(losses) if isinstance(losses, (list, tuple)) else [losses]:
        try:
            out.append(float(loss))
        except (TypeError, ValueError, RuntimeError):
            out.append(repr(loss)[:100])
    return out


def _observe(check, train_on_mesh, dp, tp, d_in, h, d_out, rows, seed) -> dict:
    data = draw(dp, d_in, d_out, rows, seed)
    with MeshServer(dp, tp, d_in, h, d_out, rows, data) as server:
        try:
            job = checks.run(check, _harness, dp * tp, hints=_HINTS,
                             args=(train_on_mesh, server.address, server.tokens, dp, tp, (d_in, h, d_out), rows),
                             timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                             expected=f"train_on_mesh returns on every rank, with its replica's {STEPS} losses")
        except CheckFailed as err:
            explain(err, server.record()["refused"])
            raise
        record = server.record()
        ref = reference(server.seed, (d_in, h, d_out), dp, tp, rows, data)
    return {"losses": job.values, "record": record, "reference": ref}


def _seen(check, train_on_mesh, config: dict) -> tuple[dict, dict, str]:
    checks.require_written(check, train_on_mesh=train_on_mesh)
    c = {**VISIBLE, **config}
    key = ("mesh", train_on_mesh, *(c[k] for k in sorted(c)))
    seen = checks.memo(check, key, lambda: _observe(check, train_on_mesh, c["dp"], c["tp"], c["d_in"], c["h"],
                                                    c["d_out"], c["rows"], c["seed"]))
    where = f"a ({c['dp']}, {c['tp']}) mesh: {c['dp']} replicas of {c['tp']} shards, {c['dp'] * c['tp']} ranks"
    return seen, c, where


def _close(a, b) -> bool:
    return bool((a - b).abs().max().item() <= ATOL)


def _at(rank: int, tp: int) -> str:
    return f"rank {rank} at (dp, tp) = ({rank // tp}, {rank % tp})"


def _first_wrong_step(seen, tp: int) -> int:
    """The first step after which some copy's weights differ from the one-process model's (STEPS if none)."""
    ref, weights = seen["reference"]["weights"], seen["record"]["weights"]
    for step in range(STEPS):
        for r, w in enumerate(weights):
            if step >= len(w) or not _close(w[step], ref[step][r % tp]):
                return step
    return STEPS


# --- the losses ----------------------------------------------------------------------------------------------------


def check_mesh_losses(train_on_mesh, **config) -> None:
    """Every rank's loss of every step equals its replica's in one process."""
    check = "check_mesh_losses"
    seen, c, where = _seen(check, train_on_mesh, config)
    dp, tp = c["dp"], c["tp"]
    ref = seen["reference"]
    judged = min(_first_wrong_step(seen, tp) + 1, STEPS)
    for r, losses in enumerate(seen["losses"]):
        d = r // tp
        if len(losses) != STEPS or any(isinstance(v, str) for v in losses):
            raise CheckFailed(check, f"train_on_mesh did not return {STEPS} losses ({where})", ranks=[r],
                              expected=f"a list of {STEPS} numbers: the replica's loss of each step", got=str(losses),
                              hint="return the list of the losses, one per batch, as floats or 0-d tensors")
        for step in range(judged):
            want, got = ref["losses"][step][d], losses[step]
            if abs(got - want) <= 1e-5 * max(1.0, abs(want)):
                continue
            raise CheckFailed(check, f"{_at(r, tp)}: the loss of step {step + 1} is not its replica's ({where})",
                              ranks=[r], expected=f"{want:.6f}: the mean squared error of the sum of the {tp} shards' "
                              f"partial outputs on replica {d}'s batch",
                              got=f"{got:.6f}" + _loss_diagnosis(got, step, d, r % tp, ref, dp, tp),
                              hint="a shard's output is partial: the model's output is the sum of the partial outputs "
                              "of the shards in this rank's tensor-parallel row (ranks "
                              f"{list(range(d * tp, d * tp + tp))}), an all-reduce over that group only")
    passed(check)


def _loss_diagnosis(got: float, step: int, d: int, t: int, ref: dict, dp: int, tp: int) -> str:
    """Which wrong combination of partial outputs gives ``got``, if one does."""
    y = ref["targets"][step][d]
    partial = ref["partial"][step]
    candidates = {
        "the rank's own partial output, not summed": partial[d][t],
        "partial outputs summed over the data-parallel column instead of the row": sum(partial[e][t] for e in range(dp)),
        "partial outputs summed over every rank": sum(partial[e][s] for e in range(dp) for s in range(tp)),
    }
    for words, pred in candidates.items():
        if abs(torch.nn.functional.mse_loss(pred, y).item() - got) <= 1e-5 * max(1.0, abs(got)):
            return f" (the loss of {words})"
    return ""


# --- the gradients ---------------------------------------------------------------------------------------------------


def _scale(got: torch.Tensor, base: torch.Tensor) -> float | None:
    """The factor c with got == c * base, if there is one."""
    norm = float((base * base).sum())
    if norm == 0:
        return None
    c = float((got * base).sum()) / norm
    return c if _close(got, c * base) else None


def _grad_diagnosis(got: torch.Tensor, step: int, r: int, ref: dict, dp: int, tp: int) -> str:
    """What the gradient ``got`` is, when it is a known wrong combination of the replicas' gradients."""
    d, t = r // tp, r % tp
    replica, want = ref["replica"][step], ref["grads"][step][t]
    c = _scale(got, want)
    if c is not None and abs(c - 1) > 1e-3:
        causes = []
        if dp > 1 and abs(c - dp) < 1e-3 * dp:
            causes.append("summed over the column, not divided by dp")
        if tp > 1 and abs(c - tp) < 1e-3 * tp:
            causes.append("the partial outputs' gradient was summed over the row again in the backward, so each "
                          "shard received the loss's gradient once per rank of its row")
        return f"{c:.3g} x the expected" + (f": {' or '.join(causes)}" if causes else "")
    bases = {
        "its own replica's gradient, not averaged over the data-parallel column": replica[d][t],
        "the gradients of the shards of its tensor-parallel row averaged: the all-reduce ran on the wrong group":
            sum(replica[d][s] for s in range(tp)) / tp,
        "every rank's gradient averaged: the all-reduce ran on the whole world":
            sum(replica[e][s] for e in range(dp) for s in range(tp)) / (dp * tp),
    }
    for words, base in bases.items():
        if base.shape != got.shape or _close(base, want) or _scale(want, base) is not None:
            continue
        k = _scale(got, base)
        if k is not None:
            return words if abs(k - 1) < 1e-3 else f"{k:.3g} x {words}"
    return f"max difference {(got - want).abs().max().item():.3g}"


def check_mesh_gradients(train_on_mesh, **config) -> None:
    """The gradient each rank gave its shard's step equals the whole batch's gradient of that shard."""
    check = "check_mesh_gradients"
    seen, c, where = _seen(check, train_on_mesh, config)
    dp, tp = c["dp"], c["tp"]
    ref, steps = seen["reference"], seen["record"]["steps"]
    judged = min(_first_wrong_step(seen, tp) + 1, STEPS)
    for step in range(judged):
        for r, given in enumerate(steps):
            if step >= len(given):
                raise CheckFailed(check, f"{_at(r, tp)} did not step its shard in step {step + 1} ({where})", ranks=[r],
                                  expected="shard.step(grad) once per batch", got=f"{len(given)} steps in all",
                                  hint="after each batch's backward, give the shard its averaged gradient")
            want = ref["grads"][step][r % tp]
            if not _close(given[step], want):
                raise CheckFailed(check, f"{_at(r, tp)}: its shard's step {step + 1} was given the wrong gradient "
                                  f"({where})", ranks=[r],
                                  expected="the gradient of the loss over every replica's batch: the shard's gradients "
                                  f"averaged over the data-parallel column (ranks {list(range(r % tp, dp * tp, tp))})",
                                  got=_grad_diagnosis(given[step], step, r, ref, dp, tp),
                                  hint="shard.grad() is this replica's gradient; average it over the ranks that hold "
                                  "the same shard (this rank's column), and count the loss's gradient once per row: "
                                  "every rank of a row computes the same loss")
    passed(check)


# --- the training ----------------------------------------------------------------------------------------------------


def check_mesh_training(train_on_mesh, **config) -> None:
    """After every step every copy of every shard equals the one-process model's slice; each rank stepped its own
    shard once a step and nothing else."""
    check = "check_mesh_training"
    seen, c, where = _seen(check, train_on_mesh, config)
    tp = c["tp"]
    record, ref = seen["record"], seen["reference"]
    if any(len(p) > 1 for p in record["pids"]) or record["refused"]:
        raise CheckFailed(check, f"a shard was reached by a process other than its rank's ({where})",
                          ranks=[r for r, p in enumerate(record["pids"]) if len(p) > 1],
                          expected="each rank drives its own shard", got="; ".join(record["refused"][:2]),
                          hint="use the shard the function is given")
    for r, weights in enumerate(record["weights"]):
        if len(weights) != STEPS:
            raise CheckFailed(check, f"{_at(r, tp)} stepped its shard {len(weights)} times ({where})", ranks=[r],
                              expected=f"{STEPS} steps, one per batch", got=str(len(weights)),
                              hint="one shard.step(grad) per batch")
    step = _first_wrong_step(seen, tp)
    if step < STEPS:
        bad = [r for r, w in enumerate(record["weights"]) if not _close(w[step], ref["weights"][step][r % tp])]
        diff = max((record["weights"][r][step] - ref["weights"][step][r % tp]).abs().max().item() for r in bad)
        raise CheckFailed(check, f"after step {step + 1}, the shards of ranks {bad} differ from the one-process "
                          f"model's ({where})", ranks=bad,
                          expected="every copy of a shard equal to the model trained on every replica's batch",
                          got=f"max difference {diff:.3g}",
                          hint="the copies of a shard stay equal only if every rank of its column steps with the same "
                          "averaged gradient (check_mesh_gradients says which)")
    passed(check)


# --- the prediction --------------------------------------------------------------------------------------------------

#: what a call of the grader's answer (or a copy of it) raises in the predicting rank
REFUSED = ("graders.two_dimensions's placements and traffic are the grader's reference, refused to the answer: work "
           "them out from how the model is split")
PARAMETERS = ("up.weight", "up.bias", "down.weight")


def mesh_truth(dp: int, tp: int, d_in: int, h: int, d_out: int, rows: int) -> dict:
    """Each parameter's placements on the (dp, tp) mesh, as DTensor names them, and the values each rank all-reduces
    in one training step along its row (the partial outputs) and along its column (its shard's gradient)."""
    cut = dict(zip(PARAMETERS, (0, 0, 1)))  # the dimension of each parameter that the tensor-parallel split slices
    per_shard = h // tp
    return {"placements": {name: ["Replicate()", f"Shard({dim})"] for name, dim in cut.items()},
            "row_values": d_out * rows, "column_values": per_shard * (d_in + 1 + d_out)}


def _placement(value) -> str:
    """A placement as DTensor's repr writes it, from that repr, its short form (``S(0)``, ``R``) or a name."""
    text = (repr(value) if not isinstance(value, str) else value).replace(" ", "").replace("dim=", "")
    short = {"R": "Replicate()", "Replicate": "Replicate()"}
    if text in short:
        return short[text]
    if text.startswith("S(") and text.endswith(")"):
        return f"Shard({text[2:-1]})"
    return text


def _plain(value):
    """The prediction as plain data (a dict of placements by parameter, and two ints)."""
    placements = {str(k): [_placement(p) for p in v] for k, v in dict(value["placements"]).items()}
    return {"placements": placements, "row_values": int(value["row_values"]),
            "column_values": int(value["column_values"])}


def _drawn(count: int) -> list[tuple[int, ...]]:
    draw = random.Random(os.urandom(8))
    out = []
    for _ in range(count):
        tp = draw.choice([1, 2, 4, 8])
        out.append((draw.randint(1, 8), tp, draw.randint(1, 64), tp * draw.randint(1, 32), draw.randint(1, 16),
                    draw.randint(1, 128)))
    return out


def check_mesh_prediction(predict_mesh, *, asked=((2, 2, 5, 8, 3, 4), (1, 4, 4, 8, 2, 3)), drawn: int = 0) -> None:
    """``predict_mesh(dp, tp, d_in, h, d_out, rows)``: each parameter's placements and the values a rank all-reduces
    in one step along its row and along its column, for ``asked`` and ``drawn`` more cases drawn anew."""
    check = "check_mesh_prediction"
    checks.require_written(check, predict_mesh=predict_mesh)
    asked = list(asked) + _drawn(drawn)
    answers = predictions.ask(check, predict_mesh, asked, refused=[mesh_truth], message=REFUSED, convert=_plain,
                              expected="predict_mesh returns {'placements': {...}, 'row_values': ..., "
                              "'column_values': ...}")
    for case, got in zip(asked, answers):
        want = mesh_truth(*case)
        call = f"predict_mesh{case}"
        if not isinstance(got, dict):
            raise CheckFailed(check, f"{call} did not return the dict asked for", expected=str(want), got=got,
                              hint="return {'placements': {parameter: [placement on dp, placement on tp]}, "
                              "'row_values': int, 'column_values': int}")
        dp, tp = case[:2]
        for name in PARAMETERS:
            # along a dimension of one rank that rank's slice is the whole tensor: "Shard(k)" and "Replicate()" both say so
            allowed = [want["placements"][name]] + ([want["placements"][name][:1] + ["Replicate()"]] if tp == 1 else [])
            if got["placements"].get(name) not in allowed:
                raise CheckFailed(check, f"{call}: the placements of {name} are wrong",
                                  expected=str(want["placements"][name]), got=str(got["placements"].get(name)),
                                  hint="along dp every rank of a column holds the same copy; along tp each rank of a "
                                  "row holds a slice: which dimension of the weight does a shard cut?")
        for key, words in (("row_values", "along the row (the partial outputs)"),
                           ("column_values", "along the column (the shard's gradient)")):
            alone = tp == 1 if key == "row_values" else dp == 1  # an all-reduce over one rank moves nothing
            if got[key] != want[key] and not (alone and got[key] == 0):
                raise CheckFailed(check, f"{call}: the values a rank all-reduces {words} are wrong",
                                  expected=str(want[key]), got=str(got[key]),
                                  hint="count the elements of the tensor each all-reduce carries in one step")
    passed(check)
