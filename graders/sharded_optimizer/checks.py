"""Checks for exercise 3's sharded-optimizer notebook (exercises/ex3-syncbn-sharding/sharded_optimizer.ipynb):
ZeRO stages 1 and 2 written by hand, over an Adam the grader holds (:mod:`graders.sharded_optimizer.adam`).

The student writes ``zero_step(model, optimizer, micro_batches, loss_fn, rank, world_size, stage)``: one training
step of a model replicated on every rank, whose optimizer state is sharded: each rank owns a partition of the
flattened parameters, hands it its reduced gradient (stage 1: once, after the step's micro-batches; stage 2: each
micro-batch's as soon as it is computed), steps it, and every rank ends with the whole updated model. The Adam is
the grader's, with learning rates only the grader knows and its state kept per rank in the grader's process, so
what a check judges is what the grader saw and did. One job per stage and configuration (3 steps); the checks
read it (:func:`course.checks.memo`):

* :func:`check_zero_weights`: every rank's parameters after every step equal one process's Adam on the step's
  whole batch (each element's new value exists only in the rank that stepped it: the ranks must exchange them);
* :func:`check_zero_state`: every element's optimizer state lives in exactly one rank, the same every step, no
  rank holds more than an even share (rounded up), and no rank touches another's;
* :func:`check_zero_gradients`: what each partition was given, and when: the step's gradient (mean loss over every
  micro-batch of every rank) once per step under stage 1, each micro-batch's share of it as it is done under
  stage 2;
* :func:`check_zero_memory`: ``predict_zero_memory(parameters, world_size, stage)``, bytes per rank of mixed-precision
  Adam under ZeRO's stages 0 to 3, for the asked cases and more drawn anew (run in a rank where the grader's formula
  refuses to run).
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed, passed
from graders.common import predictions
from graders.common.held import explain
from graders.sharded_optimizer import record
from graders.sharded_optimizer.adam import (
    BETAS,
    EPS,
    STEPS,
    AdamServer,
    ShardedAdam,
    draw,
    fetch_data,
    flat,
    gradients_at,
    make_model,
    micro_batches,
    numel,
    partition_bound,
    reference,
)
from graders.sharded_optimizer.record import EXACT, stepped

ATOL = 1e-5  # float32 sums over the ranks in another order differ by ~1e-7
JOB_TIMEOUT = 60.0
VISIBLE = {"world_size": 3, "widths": (6, 8, 3), "n_micro": 2, "rows": 4, "loss": "mse", "seed": 0}
LOSSES = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss}

_HINTS = [("timeout", "every rank must run the same collectives in the same order with tensors of the same size: "
                      "pad the flattened vector to a multiple of world_size so that every rank's piece has one size")]


def _harness(rank, zero_step, address, tokens, widths, n_micro, rows, init_seed, stage, loss_fn, _adam=ShardedAdam,
             _collectives=checks.collectives):
    checks.join_job()
    world_size, n = len(tokens), numel(widths)
    optimizer = _adam(address, tokens[rank], n)  # connected before the student's code runs
    data = fetch_data(optimizer)  # this rank's data only, over its own connection
    model = make_model(widths, init_seed)
    # how many collectives this rank had issued when each forward of the model began (torch's flight recorder):
    # what a rank sends between two micro-batches' forwards is what it communicated between the micro-batches
    forwards: list[list[int]] = []
    model.register_forward_pre_hook(checks.grader_hook(lambda module, args: forwards[-1].append(len(_collectives()))))
    after = []
    for step in range(STEPS):
        forwards.append([])
        zero_step(model, optimizer, micro_batches(data, widths, n_micro, rows, step), loss_fn, rank, world_size,
                  stage)
        params = list(model.parameters())
        got = sum(p.numel() for p in params)
        if got != n:
            after.append(f"a model of {got} parameter elements (it has {n})")
            break
        after.append(torch.cat([p.detach().to("cpu", torch.float32).reshape(-1) for p in params]).clone())
    issued = _collectives()
    between = [[f"{e['op']} of {_numel_of(e['sizes'])}" for a, b in zip(marks, marks[1:]) for e in issued[a:b]
                if _numel_of(e["sizes"]) > 1] for marks in forwards]  # a scalar (a logged loss) is not a gradient
    return {"after": after, "between": between}


def _numel_of(sizes) -> int:
    return sum(math.prod(s) for s in sizes)


def _observe(check, zero_step, stage, world_size, widths, n_micro, rows, loss, seed) -> dict:
    draws = draw(world_size, widths, n_micro, rows, seed)
    init_seed, loss_fn = 1000 + seed, LOSSES[loss]
    with AdamServer(world_size, numel(widths), draws) as server:
        try:
            job = checks.run(check, _harness, world_size, hints=_HINTS,
                             args=(zero_step, server.address, server.tokens, widths, n_micro, rows, init_seed, stage,
                                   loss_fn),
                             timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                             expected=f"zero_step returns on every rank, {STEPS} times")
        except CheckFailed as err:
            explain(err, server.record()["refused"])
            raise
        found = server.record()
    return {"ranks": job.values, "record": found, "draws": draws, "loss_fn": loss_fn, "expected": {},
            "start": flat(make_model(widths, init_seed)), "one_process": None,
            "run_one_process": lambda: reference(widths, init_seed, draws, world_size, n_micro, rows, loss_fn)}


def _seen(check, zero_step, stage: int, config: dict) -> tuple[dict, dict, str]:
    """The job of ``stage`` and ``config`` (the visible one's values where it says nothing): (what it saw, the
    configuration, the words that name it in a message)."""
    checks.require_written(check, zero_step=zero_step)
    if stage not in (1, 2):
        raise ValueError(f"stage is 1 or 2, not {stage!r}")
    c = {**VISIBLE, **config}
    c["widths"] = tuple(c["widths"])
    key = ("zero", zero_step, stage, *(c[k] for k in sorted(c)))
    seen = checks.memo(check, key, lambda: _observe(check, zero_step, stage, c["world_size"], c["widths"],
                                                    c["n_micro"], c["rows"], c["loss"], c["seed"]))
    if "ledger" not in seen:
        seen["ledger"] = record.ledger(seen["record"]["requests"], c["world_size"], numel(c["widths"]))
        seen["consensus"] = record.consensus(seen["ledger"], STEPS)
    where = (f"stage {stage}, {c['world_size']} ranks, a model of {numel(c['widths'])} elements, {c['n_micro']} "
             f"micro-batches a step")
    return seen, c, where


# --- what the grader's record says ------------------------------------------------------------------------------


def _names(widths) -> list[str]:
    """Each flattened element's name: ``0.weight[2, 5]``, ``2.bias[1]``."""
    out = []
    for name, p in make_model(widths, 0).named_parameters():
        for index in range(p.numel()):
            where = [int(i) for i in torch.unravel_index(torch.tensor(index), p.shape)]
            out.append(f"{name}[{', '.join(map(str, where))}]")
    return out


def _spans(elements, widths) -> str:
    """``elements`` (flat indices) in runs: "elements 0-27 (0.weight[0, 0] to 0.bias[3]), 40"."""
    elements = sorted(set(elements))
    if not elements:
        return "no elements"
    names, runs = _names(widths), []
    start = prev = elements[0]
    for e in elements[1:] + [None]:
        if e is not None and e == prev + 1:
            prev = e
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev} ({names[start]} to {names[prev]})")
        if e is not None:
            start = prev = e
    text = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more runs" if len(runs) > 4 else "")
    return f"element{'s' if len(elements) > 1 else ''} {text}"


# --- the weights ------------------------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max().item() <= ATOL)


def _gclose(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Gradients equal up to the order of float32 sums (over the ranks, the micro-batches, the rows)."""
    return bool(((got - want).abs() <= 1e-5 + 1e-4 * want.abs()).all())


def _target(seen, t: int) -> tuple[torch.Tensor, float]:
    """What every rank must hold after step t, and how close: the new values the grader's Adam returned (they only
    travel: compared exactly), or, where the ranks' steps do not make one model, one process's Adam."""
    if t < 0:
        return seen["start"], EXACT
    cons = seen["consensus"][t]
    if cons is not None:
        return cons, EXACT
    if seen["one_process"] is None:  # only where the ranks' steps do not make one model: a separate run
        seen["one_process"] = seen["run_one_process"]()["params"]
    return seen["one_process"][t], ATOL


def _expected(seen, c: dict, t: int) -> dict:
    """The gradients of step t at the parameters every rank held before it (:func:`gradients_at`): each step is
    judged from where the training really was, so float32's rounding in one step never carries into the next."""
    if t not in seen["expected"]:
        seen["expected"][t] = gradients_at(c["widths"], _target(seen, t - 1)[0], seen["draws"], t, c["world_size"],
                                           c["n_micro"], c["rows"], seen["loss_fn"])
    return seen["expected"][t]


def _first_wrong_step(seen) -> int:
    """The first step after which some rank's parameters differ from what it should hold (STEPS if none)."""
    for t in range(STEPS):
        want, tol = _target(seen, t)
        for after in (o["after"] for o in seen["ranks"]):
            if t >= len(after) or not isinstance(after[t], torch.Tensor) or (after[t] - want).abs().max() > tol:
                return t
    return STEPS


def _adam_path(seen, c: dict) -> list[dict]:
    """Per step, one process's Adam from where the ranks were: the new values from the step's gradient at the
    parameters before it (Adam's moments carried along), and how far float32's rounding of that gradient (its sums
    over ranks and micro-batches in another order) can move each: a step is judged up to that."""
    if "adam" not in seen:
        lr, n = seen["draws"]["lr"], len(seen["start"])
        m, v, path = torch.zeros(n), torch.zeros(n), []
        for t in range(STEPS):
            before, g = _target(seen, t - 1)[0], _expected(seen, c, t)["full"]
            k = t + 1

            def update(grad, m=m, v=v, k=k, before=before):
                m2, v2 = BETAS[0] * m + (1 - BETAS[0]) * grad, BETAS[1] * v + (1 - BETAS[1]) * grad * grad
                return before - lr * (m2 / (1 - BETAS[0] ** k)) / ((v2 / (1 - BETAS[1] ** k)).sqrt() + EPS)

            noise = 1e-6 + 1e-5 * g.abs()
            path.append({"new": update(g), "tol": ATOL + (update(g + noise) - update(g - noise)).abs()})
            m, v = BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g
        seen["adam"] = path
    return seen["adam"]


def _updated_wrong(seen, c: dict, t: int) -> tuple[int, list[int], float] | None:
    """Where the values every rank held after step t are not one process's Adam step from where they were: (the
    rank that stepped the first such element, its elements, the largest difference), or None."""
    step = _adam_path(seen, c)[t]
    got = _target(seen, t)[0]
    wrong = ((got - step["new"]).abs() > step["tol"]).nonzero().flatten().tolist()
    if not wrong:
        return None
    owner = next(r for r in range(c["world_size"]) if stepped(seen["ledger"], r, wrong[0]) > t)
    mine = [i for i in wrong if stepped(seen["ledger"], owner, i) > t]
    return owner, mine, (got - step["new"]).abs()[wrong].max().item()


def check_zero_weights(zero_step, stage: int = 1, **config) -> None:
    """Every rank's parameters after every step equal one process's Adam on the step's whole batch."""
    check = "check_zero_weights"
    seen, c, where = _seen(check, zero_step, stage, config)
    t = _first_wrong_step(seen)
    for step in range(t):  # every rank held the step's new values: was each step Adam's on the step's gradient?
        if seen["consensus"][step] is None:
            break  # compared with one process's Adam already
        fed = _updated_wrong(seen, c, step)
        if fed is not None:
            r, bad, diff = fed
            raise CheckFailed(check, f"rank {r}'s own partition was updated differently from one process's Adam "
                              f"(step {step + 1} of {STEPS}, {where})", ranks=[r],
                              expected="Adam's update from the step's gradient (the mean loss over every micro-batch "
                              "of every rank), from the elements' values before the step",
                              got=f"{_spans(bad, c['widths'])} differ (max difference {diff:.3g})",
                              hint="the gradient a partition is given must be the step's, averaged over the ranks, "
                              "for exactly its elements, added before its step (check_zero_gradients says which); "
                              "the values handed to optimizer.step must be the elements' current values")
    if t == STEPS:
        passed(check)
        return
    want, tol = _target(seen, t)
    before = _target(seen, t - 1)[0]
    for r, after in enumerate(o["after"] for o in seen["ranks"]):
        got = after[t] if t < len(after) else None
        if isinstance(got, torch.Tensor) and (got - want).abs().max() <= tol:
            continue
        if isinstance(got, str) or got is None:
            raise CheckFailed(check, f"after step {t + 1}, rank {r}'s model is not the model it was given ({where})",
                              ranks=[r], expected=f"the model's {len(want)} elements", got=str(got),
                              hint="update the model's own parameters in place (copy the new values into them)")
        own = [i for i in range(len(want)) if stepped(seen["ledger"], r, i) > t]
        mask = torch.zeros(len(want), dtype=torch.bool)
        mask[own] = True
        wrong = (got - want).abs() > tol
        step_words = f"step {t + 1} of {STEPS}"
        if _close(got, before):
            raise CheckFailed(check, f"rank {r}'s parameters did not change in {step_words} ({where})", ranks=[r],
                              expected="every element updated by one Adam step", got="the values before the step",
                              hint="the optimizer returns the new values of the elements it stepped: write them "
                              "into the model (its parameters, flattened in the order of model.parameters())")
        if own and _close(got[mask], want[mask]) and _close(got[~mask], before[~mask]):
            raise CheckFailed(check, f"rank {r}'s model holds its own partition's update but not the other ranks' "
                              f"({step_words}, {where})", ranks=[r],
                              expected="the whole updated model on every rank",
                              got=f"{_spans(own, c['widths'])} updated; the other elements still hold their values "
                              "before the step",
                              hint="each rank's new values exist on that rank only: gather every partition's new "
                              "values on every rank (one collective) and write them into the model")
        if own and not _close(got[mask], want[mask]):
            raise CheckFailed(check, f"rank {r}'s own partition was updated differently from one process's Adam "
                              f"({step_words}, {where})", ranks=[r],
                              expected="Adam's update from the step's gradient: the mean loss over every micro-batch "
                              "of every rank",
                              got=f"{_spans([i for i in own if wrong[i]], c['widths'])} differ (max difference "
                              f"{(got[mask] - want[mask]).abs().max().item():.3g})",
                              hint="the gradient a partition is given must be the step's, averaged over the ranks, "
                              "for exactly its elements, added before its step (check_zero_gradients says which); "
                              "the values handed to optimizer.step must be the elements' current values")
        raise CheckFailed(check, f"rank {r}'s parameters after {step_words} differ from one process's Adam "
                          f"({where})", ranks=[r], expected="one process's Adam on every rank's micro-batches",
                          got=f"{_spans(wrong.nonzero().flatten().tolist(), c['widths'])} differ (max difference "
                          f"{(got - want).abs().max().item():.3g})",
                          hint="every element is stepped by its owner once per step and its new value reaches "
                          "every rank, in its own place: the flattened order is model.parameters()'s")
    passed(check)  # not reached: some rank differs at step t


# --- the state ----------------------------------------------------------------------------------------------------


def check_zero_state(zero_step, stage: int = 1, **config) -> None:
    """Every element's optimizer state lives in exactly one rank, the same every step; no rank holds more than an
    even share (rounded up) or touches another rank's elements."""
    check = "check_zero_state"
    seen, c, where = _seen(check, zero_step, stage, config)
    world_size, ledger = c["world_size"], seen["ledger"]
    n, widths = len(ledger["steps"][0]), c["widths"]
    pids = seen["record"]["pids"]
    if any(len(p) > 1 for p in pids):
        raise CheckFailed(check, f"the optimizer was reached by processes other than the ranks' ({where})",
                          ranks=[r for r, p in enumerate(pids) if len(p) > 1],
                          expected="each rank uses the optimizer it is given",
                          got="; ".join(seen["record"]["refused"][:2]), hint="use the optimizer the function is given")
    owners = record.owners(ledger)
    held = [[i for i in range(n) if r in owners[i]] for r in range(world_size)]
    bound = partition_bound(n, world_size)
    if all(len(h) == n for h in held):
        raise CheckFailed(check, f"every rank stepped every element: each holds Adam's state of the whole model "
                          f"({where})", ranks=range(world_size),
                          expected=f"each element's state on one rank; at most {bound} elements a rank",
                          got=f"{n} elements ({8 * n} bytes of Adam's moments) on every rank",
                          hint="ZeRO's point: split the flattened parameters into world_size partitions; a rank "
                          "adds gradients to and steps its own partition only")
    shared = [i for i in range(n) if len(owners[i]) > 1]
    if shared:
        ranks = sorted(set().union(*(owners[i] for i in shared)))
        raise CheckFailed(check, f"some elements' state lives in more than one rank ({where})", ranks=ranks,
                          expected="each element stepped by one rank, the same every step",
                          got=f"{_spans(shared, widths)} stepped by ranks {ranks}",
                          hint="each element has one owner for the whole training: the partition must not depend "
                          "on the step, and the partitions of the ranks must not overlap")
    never = [i for i in range(n) if not owners[i]]
    if never:
        raise CheckFailed(check, f"some elements were never stepped ({where})", ranks=range(world_size),
                          expected=f"every one of the {n} elements in some rank's partition",
                          got=f"{_spans(never, widths)} never stepped",
                          hint=f"the partitions must cover every element: {n} elements over {world_size} ranks, "
                          f"at most {bound} a rank; the last partition may be shorter")
    for i in range(n):
        (owner,) = owners[i]
        times = stepped(ledger, owner, i)
        if times != STEPS:
            raise CheckFailed(check, f"rank {owner} stepped an element {times} times in {STEPS} steps ({where})",
                              ranks=[owner], expected="one optimizer.step a training step",
                              got=f"{_spans([i], widths)} stepped {times} times",
                              hint="call optimizer.step once per training step for each element of the partition")
    for r in range(world_size):
        foreign = [i for i in range(n) if r not in owners[i] and any(ledger["adds"][r][i])]
        if foreign:
            owner = next(iter(owners[foreign[0]]))
            raise CheckFailed(check, f"rank {r} added gradients to elements another rank owns ({where})", ranks=[r],
                              expected=f"only the owner adds to its elements ({_spans(foreign[:1], widths)}: "
                              f"rank {owner})",
                              got=f"rank {r} added to {_spans(foreign, widths)}: state it should not hold",
                              hint="a rank hands only its own partition's gradient to the optimizer; the other "
                              "ranks' shares reach their owners through the reduction")
    for r, h in enumerate(held):
        if len(h) > bound:
            raise CheckFailed(check, f"rank {r}'s partition is more than an even share ({where})", ranks=[r],
                              expected=f"at most {bound} elements ({n} over {world_size} ranks, rounded up)",
                              got=f"{len(h)} elements: {_spans(h, widths)}",
                              hint="split the flattened parameters themselves, not whole tensors: an even share "
                              "cuts through parameters")
    print(f"each rank holds Adam's state of {[len(h) for h in held]} of the {n} elements "
          f"({[8 * len(h) for h in held]} bytes of moments; {8 * n} without sharding)")
    passed(check)


# --- the gradients ------------------------------------------------------------------------------------------------


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The factor c with got == c * want, if there is one."""
    scale = float(want.abs().max())
    if scale == 0:
        return None
    c = float((got * want).sum() / (want * want).sum())
    return c if (got - c * want).abs().max().item() <= ATOL * max(1.0, abs(c)) + 1e-4 * scale * abs(c) else None


def _explain_values(got, want, local, world_size, n_micro, what: str, so_far=None) -> tuple[str, str]:
    """(what was given, what to try) for gradient values ``got`` that should be ``want`` (``local``: the rank's own
    gradient, not averaged; ``so_far``: under stage 2, the sum of this and the step's earlier micro-batches' shares)."""
    if so_far is not None and _close(got, so_far):
        return (f"{what}: the sum of this and the earlier micro-batches' gradients (.grad kept theirs)",
                "stage 2 hands over each micro-batch's own gradient: .grad accumulates over backward passes, so zero "
                "it before each micro-batch's backward")
    if local is not None and _close(got, local):
        return (f"{what}: this rank's own gradient, not averaged over the ranks",
                "reduce the gradient over the ranks (a sum, divided by world_size) before handing it to the "
                "partition")
    ratio = _ratio(got, want)
    named = {world_size: "summed over the ranks and not divided by world_size",
             n_micro: f"not divided by the {n_micro} micro-batches: each micro-batch's loss is its share of the "
                      "step's",
             world_size * n_micro: "summed over the ranks and the micro-batches, divided by neither"}
    for factor, words in named.items():
        if ratio is not None and factor > 1 and abs(ratio - factor) < 1e-3 * factor:
            return (f"{what}: {factor} x the expected values ({words})",
                    "the step's gradient is the mean loss's over every micro-batch of every rank; Adam hides a "
                    "constant factor in the weights, but any other optimizer, weight decay or clipping would not")
    return (f"{what}: max difference {(got - want).abs().max().item():.3g}",
            "hand the partition the gradient of its own elements, in the flattened order of model.parameters()")


def check_zero_gradients(zero_step, stage: int = 1, **config) -> None:
    """What each partition was given, and when: stage 1, the step's gradient once per step; stage 2, each
    micro-batch's share as it is done."""
    check = "check_zero_gradients"
    seen, c, where = _seen(check, zero_step, stage, config)
    world_size, n_micro, widths = c["world_size"], c["n_micro"], c["widths"]
    ledger = seen["ledger"]
    judged = min(_first_wrong_step(seen) + 1, STEPS)  # a step is judged while its parameters were right at its start
    expected_adds = 1 if stage == 1 else n_micro
    for t in range(judged):
        for r in range(world_size):
            elements = [i for i in range(len(ledger["steps"][r])) if stepped(ledger, r, i) > t]  # rank r's step t
            if not elements:
                continue
            adds = [ledger["adds"][r][i][t] for i in elements]
            counts = sorted({len(a) for a in adds})
            step_words = f"step {t + 1}"
            if counts != [expected_adds]:
                bad = [i for i, a in zip(elements, adds) if len(a) != expected_adds]
                got_n = len(ledger["adds"][r][bad[0]][t])
                if stage == 1 and got_n == n_micro and n_micro > 1:
                    summary, hint = ("stage 1 hands a partition its gradient once a step; rank "
                                     f"{r} handed one per micro-batch",
                                     "accumulate the micro-batches' gradients locally (no communication), then reduce "
                                     "the step's gradient once and give the partition its share")
                elif stage == 2 and got_n == 1 and n_micro > 1:
                    summary, hint = ("stage 2 hands a partition each micro-batch's gradient as soon as it is "
                                     f"computed; rank {r} handed one for {n_micro} micro-batches",
                                     "the whole gradient was kept across the micro-batches, as in stage 1: after "
                                     "each micro-batch's backward, reduce its gradient so that each rank receives its "
                                     "own partition's share, add it to the partition, and let the rest go")
                elif got_n == 0:
                    summary, hint = (f"rank {r} stepped elements without adding their gradient",
                                     "add the partition's reduced gradient before stepping it")
                else:
                    summary, hint = (f"rank {r} added gradients {got_n} times to an element in one step",
                                     f"stage {stage}: {expected_adds} add{'s' if expected_adds > 1 else ''} per "
                                     "element per step")
                raise CheckFailed(check, f"{summary} ({step_words}, {where})", ranks=[r],
                                  expected=f"{expected_adds} add_grad per element per step",
                                  got=f"{got_n} for {_spans(bad, widths)}", hint=hint)
            values = torch.tensor(adds).T  # (adds, elements)
            index = torch.tensor(elements)
            exp = _expected(seen, c, t)
            if stage == 1:
                wants = [exp["full"][index]]
                locals_ = [exp["local"][r][index]]
            else:
                wants = [exp["per_micro"][k][index] for k in range(n_micro)]
                locals_ = [exp["local_micro"][r][k][index] for k in range(n_micro)]
            for k, (got, want, local) in enumerate(zip(values, wants, locals_)):
                if _gclose(got, want):
                    continue
                what = (f"the gradient given in step {t + 1}" if stage == 1 else
                        f"the gradient given after micro-batch {k + 1} of step {t + 1}")
                so_far = sum(wants[:k + 1]) if stage == 2 and k > 0 else None
                said, hint = _explain_values(got, want, local, world_size, n_micro, what, so_far)
                expected = ("the step's gradient: the mean loss over every micro-batch of every rank" if stage == 1
                            else f"micro-batch {k + 1}'s gradient averaged over the ranks, divided by {n_micro}")
                raise CheckFailed(check, f"rank {r}'s partition was given the wrong gradient ({step_words}, "
                                  f"{where})", ranks=[r], expected=expected,
                                  got=f"{said} ({_spans(elements, widths)})", hint=hint)
    for r, o in enumerate(seen["ranks"]):
        talked = [(t, found) for t, found in enumerate(o["between"][:judged]) if found]
        if stage == 1 and talked:
            t, found = talked[0]
            raise CheckFailed(check, f"stage 1 communicates once a step, after its micro-batches; rank {r} issued "
                              f"collectives between two micro-batches' forwards (step {t + 1}, {where})", ranks=[r],
                              expected="no collective between the first micro-batch's forward and the last's",
                              got=f"{', '.join(found[:4])}{' ...' if len(found) > 4 else ''} (torch's flight recorder)",
                              hint="accumulate the micro-batches' gradients locally, in .grad or a buffer of your own, "
                              "and reduce the step's gradient once, after the last micro-batch's backward")
    passed(check)


# --- the prediction ------------------------------------------------------------------------------------------------

#: what a call of the grader's formula (or a copy of it) raises in the predicting rank
REFUSED = ("graders.sharded_optimizer's memory formula is the grader's reference, refused to the answer: work out the "
           "bytes from what each rank keeps")
STAGES = (0, 1, 2, 3)


def zero_memory(parameters: float, world_size: int, stage: int) -> float:
    """Bytes per rank of mixed-precision Adam (bf16 parameters and gradients, fp32 master copy and two moments)
    under ZeRO ``stage`` (0: plain data parallelism)."""
    p, n = parameters, world_size
    return {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]


def _drawn(count: int) -> list[tuple[int, int, int]]:
    draw_ = random.Random(os.urandom(8))
    return [(draw_.randint(10 ** 6, 10 ** 11), draw_.choice([1, 2, 3, 8, 12, 64, 100, 512, 1024]), draw_.choice(STAGES))
            for _ in range(count)]


_STAGE_HINTS = {
    0: "without sharding each rank keeps everything: 2 bytes of bf16 weights, 2 of bf16 gradients, 12 of fp32 state "
       "(master weights and Adam's two moments) per parameter",
    1: "stage 1 shards the fp32 optimizer state (12 bytes a parameter); each rank still keeps all the bf16 weights "
       "and gradients (2 + 2 bytes)",
    2: "stage 2 shards the gradients as well: each rank keeps all the bf16 weights (2 bytes) and its share of the "
       "gradients and optimizer state (2 + 12 bytes)",
    3: "stage 3 shards everything, weights included: 16 bytes a parameter over world_size ranks",
}


def check_zero_memory(predict_zero_memory, *, asked=((7_500_000_000, 64, 0), (7_500_000_000, 64, 1),
                                                       (7_500_000_000, 64, 2), (7_500_000_000, 64, 3)),
                      drawn: int = 0) -> None:
    """``predict_zero_memory(parameters, world_size, stage)`` -> bytes per rank equals ZeRO's, for ``asked`` and
    ``drawn`` more cases drawn anew for every check."""
    check = "check_zero_memory"
    checks.require_written(check, predict_zero_memory=predict_zero_memory)
    asked = list(asked) + _drawn(drawn)
    answers = predictions.ask(check, predict_zero_memory, asked, refused=[zero_memory], message=REFUSED,
                              expected="predict_zero_memory(parameters, world_size, stage) returns a number of bytes")
    for (p, n, s), got in zip(asked, answers):
        want = zero_memory(p, n, s)
        call = f"predict_zero_memory({p:_}, {n}, {s})"
        if isinstance(got, str):
            raise CheckFailed(check, f"{call} did not return a number", expected=f"{want:.6g} bytes", got=got,
                              hint="return the bytes one rank holds, as an int or a float")
        if abs(got - want) > 1e-6 * want:
            others = [k for k in STAGES if k != s and abs(got - zero_memory(p, n, k)) <= 1e-6 * want]
            extra = f" (that is stage {others[0]}'s)" if others else ""
            raise CheckFailed(check, f"{call} is wrong", expected=f"{want:,.0f} bytes ({want / 2 ** 30:.4g} GiB)",
                              got=f"{got:,.0f} bytes{extra}", hint=_STAGE_HINTS[s])
    passed(check)
