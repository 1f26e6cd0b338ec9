"""Checks for exercise 1's mixture-of-experts notebook (exercises/ex1-parallelism/expert_parallel.ipynb): expert
parallelism by hand, tokens dispatched to the rank of their expert and the outputs brought back, with a capacity.

The student writes ``moe_layer(experts, rank, world_size, x, expert_ids, gates, capacity)``: this rank's output of
the layer of :mod:`graders.expert_parallel.layer` (its rule: a token goes to the expert the router chose, weighted by its
gate; an expert takes at most ``capacity`` tokens of the step, rank 0's first; a token past it is dropped, output
zero). The experts are the grader's: a rank runs only its own, through ``experts(e, tokens)``, so every token an
expert takes must travel to that expert's rank and its output back. One job per configuration; three checks read
it (:func:`course.checks.memo`):

* :func:`check_moe_outputs`: every rank's output equals one process's with every expert (the experts' weights are
  known to the grader alone, so no rank can compute another rank's experts: the values must come through them);
* :func:`check_moe_gradients`: the gradient of ``sum_r (y_r * w_r)`` (``w_r`` drawn in the rank from the OS's
  randomness) reaches each rank's tokens and every expert's weights (accumulated in the grader's process) as in
  one process: the exchange must carry gradients back;
* :func:`check_moe_dispatch`: each expert was given exactly the tokens the rule gives it (the grader's record of
  its inputs, matched row by row with the tokens it routes there), never more than ``capacity``; every expert was
  run by its own rank (a second connection is refused).
"""

from __future__ import annotations

import os

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common.held import explain
from graders.expert_parallel.layer import Experts, ExpertServer, reference, routing

ATOL = 1e-5
JOB_TIMEOUT = 60.0
VISIBLE = {"world_size": 3, "per_rank": 2, "tokens": 8, "d": 4, "capacity": 4, "seed": 0}
_URANDOM = os.urandom  # bound at import

_HINTS = [("timeout", "every rank must call the same collectives, in the same order, with split sizes that agree: "
                      "what rank a sends to rank b is what rank b expects from rank a"),
          ("is not on rank", "a rank runs only its own experts: send each token to the rank that holds its expert "
                             "and bring the output back")]


def _weights(world_size: int, tokens: int, d: int) -> list[torch.Tensor]:
    """The loss weights w_r: one per rank, drawn here (the check's process) from the OS's randomness."""
    gen = torch.Generator().manual_seed(int.from_bytes(_URANDOM(6), "little"))
    return [torch.randn(tokens, d, generator=gen) for _ in range(world_size)]


def _harness(rank, moe_layer, address, tokens, per_rank, d, routes, capacity, w, _experts=Experts):
    checks.join_job()
    world_size = len(routes)
    experts = _experts(address, tokens[rank], rank, per_rank, d)  # connected before the student's code runs
    route = routes[rank]
    x = route["x"].clone().requires_grad_(True)
    y = moe_layer(experts, rank, world_size, x, route["ids"].clone(), route["gates"].clone(), capacity)
    if not isinstance(y, torch.Tensor):
        return {"y": f"a {type(y).__name__}", "x_grad": None, "why": None}
    out = {"y": y.detach().cpu().clone(), "x_grad": None, "why": None}
    if tuple(y.shape) != tuple(x.shape):
        return out
    if not y.requires_grad:
        out["why"] = "the output does not require grad: no gradient can flow back to the tokens"
        return out
    (grad,) = torch.autograd.grad(y, x, w[rank], allow_unused=True)
    out["x_grad"] = None if grad is None else grad.detach().clone()
    if grad is None:
        out["why"] = "the output does not depend on the tokens through autograd"
    return out


def _observe(check, moe_layer, world_size, per_rank, tokens, d, capacity, seed) -> dict:
    routes = routing(seed, world_size, per_rank, tokens, d)
    w = _weights(world_size, tokens, d)
    with ExpertServer(world_size, per_rank, d) as server:
        try:
            job = checks.run(check, _harness, world_size, hints=_HINTS,
                             args=(moe_layer, server.address, server.tokens, per_rank, d, routes, capacity, w),
                             timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                             expected="moe_layer returns on every rank, with a (tokens, d) output")
        except CheckFailed as err:
            explain(err, server.report()["refused"])
            raise
        return {"ranks": job.values, "held": server.report(), "routes": routes,
                "reference": reference(server.seed, d, world_size * per_rank, routes, capacity, w)}


def _seen(check, moe_layer, config: dict) -> tuple[dict, dict, str]:
    """The job of ``config`` (the visible one's values where it says nothing) for ``check``: (what it saw, the
    configuration, the words that name it in a message)."""
    checks.require_written(check, moe_layer=moe_layer)
    c = {**VISIBLE, **config}
    key = ("experts", moe_layer, *(c[k] for k in sorted(c)))
    seen = checks.memo(check, key, lambda: _observe(check, moe_layer, c["world_size"], c["per_rank"], c["tokens"],
                                                    c["d"], c["capacity"], c["seed"]))
    where = (f"{c['world_size']} ranks, {c['per_rank']} expert{'s' if c['per_rank'] > 1 else ''} each, "
             f"{c['tokens']} tokens a rank, capacity {c['capacity']}")
    return seen, c, where


# --- the outputs ------------------------------------------------------------------------------------------------


def check_moe_outputs(moe_layer, **config) -> None:
    """Every rank's output equals one process's with every expert, dropped tokens zero."""
    check = "check_moe_outputs"
    seen, c, where = _seen(check, moe_layer, config)
    capacity = c["capacity"]
    ref = seen["reference"]
    for r, (obs, want) in enumerate(zip(seen["ranks"], ref["outputs"])):
        y = obs["y"]
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(want.shape):
            raise CheckFailed(check, f"moe_layer returned {y if isinstance(y, str) else tuple(y.shape)} ({where})",
                              ranks=[r], expected=f"a tensor of shape {tuple(want.shape)}: one output per token",
                              got=str(y if isinstance(y, str) else tuple(y.shape)),
                              hint="return this rank's output, one row per token, in the tokens' order")
        if (y - want).abs().max().item() <= ATOL:
            continue
        mask = ref["kept"][r]
        route = seen["routes"][r]
        dropped = (~mask).nonzero().flatten().tolist()
        if dropped and y[~mask].abs().max().item() > ATOL and (y[mask] - want[mask]).abs().max().item() <= ATOL:
            raise CheckFailed(check, f"tokens past their expert's capacity got an output ({where})", ranks=[r],
                              expected=f"zero for tokens {dropped} of rank {r}: their experts already had "
                              f"{capacity} tokens from the ranks before them or earlier in rank {r}",
                              got=f"non-zero rows {[t for t in dropped if y[t].abs().max().item() > ATOL]}",
                              hint="an expert takes at most capacity tokens of the whole step, rank 0's first: "
                              "count, for each expert, the tokens every lower rank sends it (a collective), then "
                              "this rank's own in order")
        ungated = torch.where(mask[:, None], want / route["gates"][:, None], torch.zeros_like(want))
        if (y - ungated).abs().max().item() <= ATOL:
            raise CheckFailed(check, f"the outputs are the experts' outputs without the gate weights ({where})",
                              ranks=[r], expected="gates[t] * expert(x[t]) for a kept token",
                              got="expert(x[t])", hint="multiply each token's expert output by its gate weight")
        bad = [t for t in range(len(y)) if (y[t] - want[t]).abs().max().item() > ATOL]
        raise CheckFailed(check, f"rank {r}'s outputs differ from one process's with every expert ({where})",
                          ranks=[r], expected="gates[t] * expert(x[t]) for a kept token, zero for a dropped one",
                          got=f"tokens {bad} differ (max difference {(y - want).abs().max().item():.3g})",
                          hint="each token must come back from its expert to its own place: the outputs return in "
                          "the order the tokens were sent, and each rank's split sizes must agree with its "
                          "peers'; an expert's capacity counts the tokens of rank 0 first")
    passed(check)


# --- the gradients ----------------------------------------------------------------------------------------------


def check_moe_gradients(moe_layer, **config) -> None:
    """The gradient of sum_r (y_r * w_r) reaches every rank's tokens and every expert's weights as in one process."""
    check = "check_moe_gradients"
    seen, c, where = _seen(check, moe_layer, config)
    per_rank = c["per_rank"]
    ref = seen["reference"]
    for r, (obs, want) in enumerate(zip(seen["ranks"], ref["x_grads"])):
        grad = obs["x_grad"]
        if grad is None:
            raise CheckFailed(check, f"no gradient reached rank {r}'s tokens ({where})", ranks=[r],
                              expected="x.grad of sum(y * w), through the experts and back",
                              got=obs["why"] or "no output of the right shape",
                              hint="dist.all_to_all_single is not differentiable: the output it fills has no "
                              "history. torch.distributed.nn.functional.all_to_all_single is (its backward runs the "
                              "reverse exchange); use it for the tokens going out and their outputs coming back")
        if (grad - want).abs().max().item() > ATOL:
            y, y_want = obs["y"], ref["outputs"][r]
            outputs_wrong = not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(y_want.shape) or \
                (y - y_want).abs().max().item() > ATOL
            raise CheckFailed(check, f"rank {r}'s tokens' gradients differ from one process's ({where})", ranks=[r],
                              expected="x.grad of sum(y * w) in one process",
                              got=f"max difference {(grad - want).abs().max().item():.3g}"
                              + (" (the outputs differ already: check_moe_outputs says how)" if outputs_wrong else ""),
                              hint="make the outputs right first (check_moe_outputs): the gradients follow the forward"
                              if outputs_wrong else "the gradient must travel back the way the tokens came: every "
                              "exchange of the forward, differentiable, with the gates applied where the outputs are "
                              "combined")
    for e, (held, want) in enumerate(zip(seen["held"]["modules"], ref["expert_grads"])):
        got = {k: v if v is not None else torch.zeros_like(want[k]) for k, v in held["grads"].items()}
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        if diff > ATOL:
            owner = e // per_rank
            raise CheckFailed(check, f"expert {e}'s weight gradients differ from one process's ({where})",
                              ranks=[owner], expected="the gradient of sum(y * w) for its weights",
                              got=f"max difference {diff:.3g} (its backward ran {sum(op == 'B' for op, _, _ in held['journal'])}"
                              f" times for {sum(op == 'F' for op, _, _ in held['journal'])} forwards)",
                              hint="each call of an expert must be part of the graph that leads to the output, and "
                              "the output's gradient must come back to the expert's rank")
    passed(check)


# --- what each expert was given ------------------------------------------------------------------------------------


def check_moe_dispatch(moe_layer, **config) -> None:
    """Each expert was given exactly the tokens the rule gives it, never more than ``capacity``, by its own rank."""
    check = "check_moe_dispatch"
    seen, c, where = _seen(check, moe_layer, config)
    world_size, per_rank, tokens, capacity = (c[k] for k in ("world_size", "per_rank", "tokens", "capacity"))
    pids = seen["held"]["pids"]
    first = [p[0] for p in pids if p and p[0] != -1]  # -1: a platform that cannot say which process
    if any(len(p) > 1 for p in pids) or len(set(first)) < len(first):
        raise CheckFailed(check, f"experts were asked to work by processes other than their rank's ({where})",
                          ranks=range(world_size), expected="rank r runs its own experts, through the experts given",
                          got="; ".join(seen["held"]["refused"][:2]) or f"processes {pids}",
                          hint="each rank runs only its own experts; the tokens travel to them")
    routes = seen["routes"]
    names = {routes[r]["x"][t].numpy().tobytes(): (r, t) for r in range(world_size) for t in range(tokens)}
    for e, held in enumerate(seen["held"]["modules"]):
        owner = e // per_rank
        given = [names.get(row.numpy().tobytes(), ("?", "?")) for _, rows in held["inputs"] for row in rows]
        want = seen["reference"]["taken"][e]
        if sorted(given, key=str) == sorted(want, key=str):
            continue
        strangers = [g for g in given if g[0] == "?"]
        routed = [(r, t) for r in range(world_size) for t in range(tokens) if int(routes[r]["ids"][t]) == e]
        detail = f"it was given {len(given)} token(s) {given[:12]}; the rule gives it {want[:12]}"
        if strangers:
            raise CheckFailed(check, f"expert {e} was given rows that are not the tokens ({where})", ranks=[owner],
                              expected=f"the tokens routed to expert {e}, as they are", got=detail,
                              hint="send the tokens themselves to the experts' ranks (and nothing else as tokens)")
        if len(given) > capacity:
            from_each = [sum(1 for g in given if g[0] == r) for r in range(world_size)]
            per_rank_rule = max(from_each) <= capacity  # no rank sent more than the capacity, the ranks together did
            raise CheckFailed(check, f"expert {e} was given {len(given)} tokens, more than its capacity {capacity} "
                              f"({where})", ranks=[owner], expected=f"at most {capacity}: {want}", got=detail
                              + (f" ({from_each} from ranks 0 to {world_size - 1}: none past the capacity on its own)"
                                 if per_rank_rule else ""),
                              hint="drop a token past its expert's capacity BEFORE sending it: an overloaded expert "
                              "must not spend compute on tokens whose output is zero" + (
                                  "; and the capacity is shared by all the ranks' tokens, rank 0's first: a rank needs "
                                  "the counts the lower ranks send each expert (a collective) to know which of its own "
                                  "fit" if per_rank_rule else ""))
        extra = [g for g in given if g not in routed]
        raise CheckFailed(check, f"expert {e} was not given the tokens the rule gives it ({where})", ranks=[owner],
                          expected=f"{want}: the first {capacity} routed to it, rank 0's first", got=detail,
                          hint=(f"tokens {extra[:6]} were routed to other experts: the tokens and their expert numbers "
                                "must travel in the same order" if extra else
                                "an expert's capacity is shared by all the ranks' tokens, rank 0's first, each "
                                "rank's in order: a rank needs the other ranks' counts to know which of its own fit"))
    passed(check)
