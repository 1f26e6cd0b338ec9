"""Checks for exercise 1's pipeline notebook (exercises/ex1-parallelism/pipeline.ipynb): a pipeline schedule of
the student's own, over point-to-point operations, for p stages and m micro-batches.

The student writes ``pipeline_step(stage, rank, world_size, x, y, n_micro, schedule)``: one training step of a
model split into ``world_size`` stages (rank s holds stage s) on a batch split into ``n_micro`` equal micro-batches,
in the order of ``schedule`` ("gpipe" or "1f1b"), with the loss ``F.mse_loss`` of the whole batch; the last rank
returns it. The stages are the grader's (:mod:`graders.pipeline.stages`): a rank drives its stage with
``stage.forward(i, x)`` and ``stage.backward(i, grad)``, and moves activations and gradients to its neighbours
itself. One job per (p, m) runs both schedules, each on stages of its own; the checks read it
(:func:`course.checks.memo`):

* :func:`check_pipeline_gradients`: every stage's weight gradients, as the grader accumulated them in its own
  process, equal a single process's on the whole batch (weights only the grader knows, so no rank can compute
  another stage's part: it must come through the pipeline), and the last rank's loss is the batch's;
* :func:`check_pipeline_schedule`: each stage's work, in the order the grader ran it, is the schedule's (GPipe:
  every forward, then every backward; 1F1B: ``min(p - s, m)`` forwards, then a backward and a forward in turn,
  then the last backwards), so the micro-batches a stage holds at once peak at m (GPipe) or ``min(p - s, m)``
  (1F1B); and each stage was driven by one process of its own;
* :func:`check_pipeline_prediction`: ``predict_pipeline(p, m, schedule)``, the bubble (the fraction of stage-steps
  idle when a forward and a backward each take one step) and each stage's peak, for configurations drawn anew for
  every check, equal what :func:`simulate` measures on the schedule's orders; the grader's own orders and
  simulator refuse to run in the predicting rank (:func:`course.checks.refuse`).
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed, passed
from graders.common import predictions
from graders.common.held import explain
from graders.pipeline.stages import RemoteStage, StageServer, make_layers

SCHEDULES = ("gpipe", "1f1b")
ATOL = 1e-5  # float32 sums of micro-batches against one sum over the batch: ~1e-7 here
JOB_TIMEOUT = 60.0

_DEADLOCK = ("a receive waits until its neighbour sends: on each pair of neighbouring stages, the order in which one "
             "sends must be the order in which the other receives, and no stage may wait to receive what its "
             "neighbour only sends after waiting for it. Write down, for p = 2 and m = 3, each stage's list of steps "
             "(receive, forward or backward, send) in your schedule and pair every receive with its send")
_HINTS = [("timeout", _DEADLOCK), ("before forward(", "a stage's backward of micro-batch i needs its forward of i "
          "first, on the same stage: the activations it saved are what backward uses"),
          ("a second time", "each micro-batch goes backward through each stage once"),
          ("does not exist", "micro-batches are numbered 0 to n_micro - 1 on every stage, the same micro-batch "
           "keeping its number from the first stage to the last")]


# --- the data and the single-process reference -------------------------------------------------------------


def widths_for(p: int, seed: int) -> list[int]:
    """The model's layer widths: p + 1 of them (input, p - 1 between stages, output), public."""
    draw = random.Random(1000 * p + seed)
    return [draw.randint(3, 8) for _ in range(p + 1)]


def batch(seed: int, rows: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 99)
    return torch.randn(rows, d_in, generator=gen), torch.randn(rows, d_out, generator=gen)


def _reference(server: StageServer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[dict]]:
    """The loss and every stage's gradients of one process on the whole batch, with the server's weights."""
    layers = make_layers(server.widths, server.seed)
    loss = F.mse_loss(nn.Sequential(*layers)(x), y)
    loss.backward()
    return loss.item(), [{name: p.grad.detach().clone() for name, p in layer.named_parameters()} for layer in layers]


# --- the schedules and their simulation -----------------------------------------------------------------


def expected_order(schedule: str, p: int, m: int, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s work in ``schedule``: ("F", i) and ("B", i) in order. In 1F1B, with w = min(p - s, m)
    warm-up forwards, forward i comes at place i (i < w) or 2i - w + 1, backward i at w + 2i while forwards
    remain after it (i < m - w), else at m + i."""
    work = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "gpipe":
        return work
    w = min(p - s, m)

    def place(item: tuple[str, int]) -> int:
        op, i = item
        if op == "F":
            return i if i < w else 2 * i - w + 1
        return w + 2 * i if i < m - w else m + i

    return sorted(work, key=place)


def _gpipe_reversed(m: int) -> list[tuple[str, int]]:
    """GPipe with its backwards last micro-batch first (the GPipe paper's figure): also GPipe."""
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def simulate(orders: list[list[tuple[str, int]]]) -> dict | None:
    """Run each stage's order with every forward and backward taking one step, each starting once the stage is
    free and what it needs is done (forward i: forward i on the stage before; backward i: backward i on the
    stage after, and forward i here). {"steps", "busy", "bubble", "peak"}; None when the orders deadlock."""
    p = len(orders)
    done: dict[tuple[str, int, int], int] = {}
    free, nxt, held, peak = [0] * p, [0] * p, [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                op, i = orders[s][nxt[s]]
                needs = [(op, i, s - 1)] if op == "F" and s > 0 else []
                needs += [(op, i, s + 1)] if op == "B" and s < p - 1 else []
                needs += [("F", i, s)] if op == "B" else []
                if any(n not in done for n in needs):
                    break
                start = max([free[s]] + [done[n] for n in needs])
                done[(op, i, s)] = free[s] = start + 1
                held[s] += 1 if op == "F" else -1
                peak[s] = max(peak[s], held[s])
                nxt[s] += 1
                progress = True
    if any(nxt[s] < len(orders[s]) for s in range(p)):
        return None
    steps = max(free)
    busy = sum(len(o) for o in orders)
    return {"steps": steps, "busy": busy, "bubble": 1 - busy / (p * steps), "peak": peak}


def truth(p: int, m: int, schedule: str) -> dict:
    """The bubble and the peaks of ``schedule`` for p stages and m micro-batches."""
    return simulate([expected_order(schedule, p, m, s) for s in range(p)])


def _say(order) -> str:
    return " ".join(f"{op}{i}" for op, i in order)


# --- the job -----------------------------------------------------------------------------------------------


def _harness(rank, pipeline_step, runs, x, y, n_micro, _stage=RemoteStage):
    checks.join_job()
    checks.refuse(_reference_code(), REFUSED)  # the grader's orders are the answer's to work out, not to call
    world_size = len(runs[0][2])
    returned = []
    for schedule, address, tokens, shapes in runs:
        stage = _stage(address, tokens[rank], rank, *shapes[rank])  # connected before the student's code runs
        out = pipeline_step(stage, rank, world_size, x.clone() if rank == 0 else None,
                            y.clone() if rank == world_size - 1 else None, n_micro, schedule)
        if isinstance(out, torch.Tensor):
            out = out.detach().cpu().reshape(-1)[0].item() if out.numel() == 1 else f"a tensor of shape {tuple(out.shape)}"
        elif out is not None and not isinstance(out, (int, float)):
            out = f"a {type(out).__name__}"
        returned.append(out)
    return returned


def _observe(check, pipeline_step, p: int, m: int, rows: int, seed: int) -> dict:
    widths = widths_for(p, seed)
    x, y = batch(seed, rows * m, widths[0], widths[-1])
    servers = [StageServer(widths, rows, m) for _ in SCHEDULES]
    try:
        runs = [(schedule, srv.address, srv.tokens, srv.shapes()) for schedule, srv in zip(SCHEDULES, servers)]
        expected = (f"pipeline_step returns on every rank, the last rank with the batch's loss ({p} stages, "
                    f"{m} micro-batches, schedules {' then '.join(SCHEDULES)})")
        try:
            job = checks.run(check, _harness, p, args=(pipeline_step, runs, x, y, m), hints=_HINTS,
                             timeout=min(checks.check_timeout(), JOB_TIMEOUT), expected=expected)
        except CheckFailed as err:
            explain(err, [f"stage {s}: {r}" for srv in servers for s, st in enumerate(srv.stages()) for r in st["refused"]])
            raise
        out = {}
        for k, (schedule, srv) in enumerate(zip(SCHEDULES, servers)):
            loss, grads = _reference(srv, x, y)
            out[schedule] = {"stages": srv.stages(), "loss": loss, "grads": grads,
                             "returned": [r[k] for r in job.values]}
        return out
    finally:
        for srv in servers:
            srv.close()


def _job(check, pipeline_step, p, m, rows, seed):
    return checks.memo(check, ("pipeline", pipeline_step, p, m, rows, seed),
                       lambda: _observe(check, pipeline_step, p, m, rows, seed))


def _where(schedule, p, m) -> str:
    return f"{schedule}, {p} stages, {m} micro-batches"


# --- part 1: the gradients ----------------------------------------------------------------------------------


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() if a.get(k) is not None else math.inf for k in b)


def _scale(a: dict, b: dict) -> float:
    num = sum((a[k] * b[k]).sum().item() for k in b if a.get(k) is not None)
    den = sum((b[k] * b[k]).sum().item() for k in b)
    return num / den if den else float("nan")


def _judge_gradients(check, seen: dict, p: int, m: int) -> None:
    where = _where(seen["schedule"], p, m)
    for s, stage in enumerate(seen["stages"]):
        forwards = sorted(i for op, i, _ in stage["journal"] if op == "F")  # a repeated forward counts twice
        backwards = sorted(i for op, i, _ in stage["journal"] if op == "B")
        if forwards != list(range(m)) or backwards != list(range(m)):
            raise CheckFailed(check, f"stage {s} did not run every micro-batch forward and backward once ({where})",
                              ranks=[s], expected=f"forward and backward of micro-batches 0 to {m - 1} on stage {s}",
                              got=f"forwards of {forwards}, backwards of {backwards} (stage {s}'s work in order: "
                              f"{_say((op, i) for op, i, _ in stage['journal']) or 'none'})",
                              hint="every stage runs every micro-batch forward, and backward once its gradient has "
                              "come back from the next stage (the last stage makes it from the loss)")
    for s, (stage, ref) in enumerate(zip(seen["stages"], seen["grads"])):
        got = stage["grads"]
        diff = _max_diff(got, ref)
        if diff <= ATOL * max(1.0, max(v.abs().max().item() for v in ref.values())):
            continue
        scale = _scale(got, ref)
        expected = "the gradients of the whole batch's loss F.mse_loss(model(x), y), from one process"
        if abs(scale - m) < 1e-3 * m and _max_diff({k: v / m for k, v in got.items()}, ref) <= 10 * ATOL:
            raise CheckFailed(check, f"stage {s}'s gradients are {m} x the whole batch's: each micro-batch's loss "
                              f"was not divided by the number of micro-batches ({where})", ranks=[s],
                              expected=expected, got=f"{m} x those (max difference {diff:.3g})",
                              hint="the batch's mean loss is the mean of the micro-batches' mean losses (they are "
                              "of equal size): divide each micro-batch's loss by n_micro before its backward")
        if abs(scale - 1 / m) < 1e-3 and _max_diff({k: v * m for k, v in got.items()}, ref) <= 10 * ATOL:
            raise CheckFailed(check, f"stage {s}'s gradients are 1/{m} of the whole batch's ({where})", ranks=[s],
                              expected=expected, got=f"1/{m} of those",
                              hint="each micro-batch's mean loss is divided by n_micro once, not twice")
        raise CheckFailed(check, f"stage {s}'s gradients differ from the whole batch's ({where})", ranks=[s],
                          expected=expected, got=f"max difference {diff:.3g}",
                          hint="each stage's input for micro-batch i must be the previous stage's output for "
                          "micro-batch i, and each stage's output gradient the next stage's input gradient for the "
                          "same micro-batch; the last stage's gradient is that of its micro-batch's loss, rows i*b "
                          "to (i+1)*b of y")
    loss = seen["returned"][p - 1]
    if not isinstance(loss, (int, float)) or abs(loss - seen["loss"]) > 1e-5 * max(1.0, abs(seen["loss"])):
        raise CheckFailed(check, f"the last rank returned {loss!r}, not the batch's loss ({where})", ranks=[p - 1],
                          expected=f"{seen['loss']:.6f}: F.mse_loss over the whole batch (a float or a one-element "
                          "tensor)", got=repr(loss),
                          hint="the batch's loss is the mean of the micro-batches' losses (they are of equal size)")


def check_pipeline_gradients(pipeline_step, *, configs=((3, 4),), rows: int = 3, seed: int = 0) -> None:
    """Every stage's gradients (accumulated by the grader) equal one process's on the whole batch; the last rank
    returns the batch's loss; for both schedules, for each (stages, micro-batches) of ``configs``."""
    check = "check_pipeline_gradients"
    checks.require_written(check, pipeline_step=pipeline_step)
    for p, m in configs:
        seen = _job(check, pipeline_step, p, m, rows, seed)
        for schedule in SCHEDULES:
            _judge_gradients(check, {**seen[schedule], "schedule": schedule}, p, m)
    passed(check)


# --- part 1: the schedule -----------------------------------------------------------------------------------


def _judge_order(check, schedule: str, stages: list[dict], p: int, m: int) -> None:
    where = _where(schedule, p, m)
    for s, stage in enumerate(stages):
        if len(stage["pids"]) > 1:
            raise CheckFailed(check, f"stage {s} was asked to work by more than one connection ({where})",
                              ranks=[s], expected=f"stage {s} driven by rank {s}'s process alone",
                              got="; ".join(stage["refused"][:2]) or f"processes {stage['pids']}",
                              hint="each rank drives its own stage, through the stage it is given")
    pids = [stage["pids"][0] for stage in stages if stage["pids"][0] != -1]  # -1: a platform that cannot say
    if len(set(pids)) != len(pids):
        raise CheckFailed(check, f"one process drove several stages ({where})", ranks=range(p),
                          expected="each stage driven by its own rank", got=f"processes {pids}",
                          hint="each rank drives its own stage, through the stage it is given")
    for s, stage in enumerate(stages):
        got = [(op, i) for op, i, _ in stage["journal"]]
        wanted = expected_order(schedule, p, m, s)
        if got == wanted or (schedule == "gpipe" and got == _gpipe_reversed(m)):
            continue
        held = max((h for _, _, h in stage["journal"]), default=0)
        promised = m if schedule == "gpipe" else min(p - s, m)
        first = next((k for k, (a, b) in enumerate(zip(got, wanted)) if a != b), min(len(got), len(wanted)))
        rule = ("every forward, micro-batch 0 first, then every backward" if schedule == "gpipe" else
                f"{min(p - s, m)} forwards (p - s, at most m), then a backward and a forward in turn, then the last "
                "backwards, each in micro-batch order")
        raise CheckFailed(check, f"stage {s}'s work is not in {schedule}'s order: it first differs at step "
                          f"{first + 1} ({where})", ranks=[s], expected=f"{_say(wanted)} ({rule}; it holds at most "
                          f"{promised} micro-batches' activations at once)",
                          got=f"{_say(got)} (it held up to {held} at once)",
                          hint=f"on stage s of p, {schedule} runs {rule}: make each rank's list of steps from "
                          "its stage number, p and m, and run it in that order")


def check_pipeline_schedule(pipeline_step, *, configs=((3, 4),), rows: int = 3, seed: int = 0) -> None:
    """Each stage's work, as the grader ran it, is the schedule's, so its activations in flight peak at what the
    schedule promises; every stage driven by a process of its own; both schedules, each of ``configs``."""
    check = "check_pipeline_schedule"
    checks.require_written(check, pipeline_step=pipeline_step)
    for p, m in configs:
        seen = _job(check, pipeline_step, p, m, rows, seed)
        for schedule in SCHEDULES:
            _judge_order(check, schedule, seen[schedule]["stages"], p, m)
    passed(check)


# --- part 2: the prediction -----------------------------------------------------------------------------------

#: what a call of the grader's orders or simulator (or a copy of them) raises in the predicting rank
REFUSED = ("graders.pipeline's schedules and simulator are the grader's reference, refused to the answer: work out "
           "each stage's order, the bubble and the peaks from p, m and the schedule yourself")


def _reference_code() -> list:
    return [expected_order, _gpipe_reversed, simulate, truth]


def _plain(value):
    try:
        bubble, peaks = value
        return [float(bubble), [int(x) for x in peaks]]
    except (TypeError, ValueError, RuntimeError):
        return repr(value)[:200]


def _drawn(n: int) -> list[tuple[int, int, str]]:
    draw = random.Random(os.urandom(8))
    return [(draw.randint(2, 9), draw.randint(1, 24), draw.choice(SCHEDULES)) for _ in range(n)]


#: how far a predicted bubble may be from the schedule's: float32's rounding of a right formula (about 1e-7 here)
#: passes; a wrong formula misses by far more (two bubbles of the configurations asked differ by 1e-3 at least)
BUBBLE_TOLERANCE = 1e-6


def check_pipeline_prediction(predict_pipeline, *, asked=((3, 4, "gpipe"), (3, 4, "1f1b"), (4, 8, "1f1b")),
                              drawn: int = 0) -> None:
    """``predict_pipeline(p, m, schedule)`` -> (bubble, peaks per stage) equals the schedule's, for ``asked``
    and ``drawn`` more configurations drawn anew for every check."""
    check = "check_pipeline_prediction"
    checks.require_written(check, predict_pipeline=predict_pipeline)
    asked = list(asked) + _drawn(drawn)
    answers = predictions.ask(check, predict_pipeline, asked, refused=_reference_code(), message=REFUSED, convert=_plain,
                              expected="predict_pipeline(p, m, schedule) returns (bubble, [peak of stage 0, ...])")
    for (p, m, schedule), got in zip(asked, answers):
        right = truth(p, m, schedule)
        where = f"{schedule}, {p} stages, {m} micro-batches"
        if not isinstance(got, list):
            raise CheckFailed(check, f"predict_pipeline({p}, {m}, {schedule!r}) did not return (bubble, peaks)",
                              expected="a float and a list of p ints", got=got,
                              hint="return a pair: the bubble fraction, and the list of each stage's peak")
        bubble, peaks = got
        if abs(bubble - right["bubble"]) > BUBBLE_TOLERANCE:
            raise CheckFailed(check, f"the predicted bubble is wrong ({where})", expected=f"{right['bubble']:.9g}",
                              got=f"{bubble:.9g}", hint="count, for the whole step, the time steps each stage "
                              "is idle while another works; a forward and a backward each take one step; divide by "
                              "p x the step's length")
        if peaks != right["peak"]:
            raise CheckFailed(check, f"the predicted peaks are wrong ({where})", expected=str(right["peak"]),
                              got=str(peaks), hint="a stage holds a micro-batch's activations from its forward to "
                              "its backward: count the most it holds at once, stage by stage")
    passed(check)
