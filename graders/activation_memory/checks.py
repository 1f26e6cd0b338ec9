"""Checks for exercise 3's activation-memory notebook (exercises/ex3-syncbn-sharding/activation_memory.ipynb): what
a block keeps for backward, and activation checkpointing chosen for a memory budget.

The blocks are the grader's (:mod:`graders.activation_memory.blocks`): the activations a block saves for backward
are kept in the grader's process, for as long as the rank's autograd graph holds that call, so the grader counts
what is held at once, and every forward (a recomputation is a block's second forward), itself.

* :func:`check_saved_bytes`: ``predict_saved_bytes(rows, d, h)``, the bytes of the tensors one block saves for
  backward (parameters excluded), equal the grader's measurement (``saved_tensors_hooks`` in its own process) for
  the asked sizes and more drawn anew; the prediction runs in a rank where the grader's measurement refuses to run;
* :func:`check_checkpoint_gradients`: ``run_blocks(blocks, x, budget)``'s output, and the gradients of
  ``sum(out * w)`` (``w`` drawn in the check's process) for ``x`` and for every block's weights (accumulated in the
  grader), equal one process's without checkpointing;
* :func:`check_checkpoint_plan`: the most the grader held at once fits ``budget``, each block's backward ran once,
  and the recomputation (each recomputed block's multiply-adds) is the least any choice of blocks needs to fit it.
"""

from __future__ import annotations

import os
import random

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.activation_memory.blocks import Block, Blocks, BlockServer, best_plans, cost, peak, reference, saved_bytes
from graders.common import predictions
from graders.common.held import explain

ATOL = 1e-5
JOB_TIMEOUT = 60.0
VISIBLE = {"rows": 8, "d": 16, "hiddens": (32, 96, 64, 128, 48, 80), "budget": 19360, "seed": 0}


#: what a call of the grader's peak rule or plan search (or a copy of them) raises in run_blocks's rank
PLAN_REFUSED = ("graders.activation_memory's peak rule and plan search are the grader's reference, refused to the "
                "answer: work out what is held at each moment, and which blocks to checkpoint, yourself")


def _harness(rank, run_blocks, address, token, d, hiddens, rows, budget, x, w):
    checks.join_job()
    checks.refuse([peak, best_plans], PLAN_REFUSED)  # the plan is the answer's to work out, not to call
    blocks = Blocks(address, token, d, hiddens, rows)  # connected before the student's code runs
    leaf = x.clone().requires_grad_(True)
    out = run_blocks(blocks, leaf, budget)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
        what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"out": f"returned {what}", "x_grad": None}
    if not out.requires_grad:
        return {"out": out.detach().clone(), "x_grad": None, "why": "the output does not require grad"}
    (out * w).sum().backward()
    return {"out": out.detach().clone(), "x_grad": None if leaf.grad is None else leaf.grad.detach().clone()}


def _observe(check, run_blocks, rows, d, hiddens, budget, seed) -> dict:
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(6), "little") ^ seed)
    x, w = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen)
    with BlockServer(d, hiddens, rows) as server:
        try:
            job = checks.run(check, _harness, 1, args=(run_blocks, server.address, server.tokens[0], d, hiddens, rows,
                                                       budget, x, w),
                             timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                             expected="run_blocks returns the last block's output, and its backward runs")
        except CheckFailed as err:
            explain(err, [t for _, t in server.refused])
            raise
        record = server.record()
        ref = reference(server.blocks, x, w)
    return {"rank": job.values[0], "record": record, "reference": ref}


def _seen(check, run_blocks, config: dict) -> tuple[dict, dict, str]:
    checks.require_written(check, run_blocks=run_blocks)
    c = {**VISIBLE, **config}
    c["hiddens"] = tuple(c["hiddens"])
    key = ("blocks", run_blocks, *(c[k] for k in sorted(c)))
    seen = checks.memo(check, key, lambda: _observe(check, run_blocks, c["rows"], c["d"], c["hiddens"], c["budget"],
                                                    c["seed"]))
    where = f"{len(c['hiddens'])} blocks of hidden widths {list(c['hiddens'])}, budget {c['budget']:,} bytes"
    return seen, c, where


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --- the gradients ------------------------------------------------------------------------------------------------


def check_checkpoint_gradients(run_blocks, **config) -> None:
    """The output and the gradients for x and every block's weights equal one process's without checkpointing."""
    check = "check_checkpoint_gradients"
    seen, c, where = _seen(check, run_blocks, config)
    got, ref, record = seen["rank"], seen["reference"], seen["record"]
    if isinstance(got["out"], str) or _maxdiff(got["out"], ref["out"]) > ATOL:
        what = got["out"] if isinstance(got["out"], str) else f"max difference {_maxdiff(got['out'], ref['out']):.3g}"
        raise CheckFailed(check, f"run_blocks's output is not the blocks' ({where})", ranks=[0],
                          expected=f"the last block's output, shape ({c['rows']}, {c['d']}): every block once, in order",
                          got=what, hint="run each block on the previous block's output, in order, and return the last")
    missing = [i for i, n in enumerate(record["backwards"]) if n == 0]
    if got.get("x_grad") is None or missing:
        raise CheckFailed(check, f"the gradient did not reach {'blocks ' + str(missing) if missing else 'x'} ({where})",
                          ranks=[0], expected="the backward of every block, down to x",
                          got=got.get("why") or (f"the backward of blocks {missing} never ran" if missing else "x.grad is None"),
                          hint="a block run under torch.no_grad() leaves no graph: a checkpointed block must be run "
                          "again with gradients when its backward comes, which is what a checkpoint does")
    for i, (grads, want) in enumerate(zip(record["grads"], ref["grads"])):
        diff = max(_maxdiff(grads[k], want[k]) if grads[k] is not None else float("inf") for k in want)
        if diff > ATOL:
            twice = record["backwards"][i] > 1
            raise CheckFailed(check, f"block {i}'s weight gradients differ from one process's ({where})", ranks=[0],
                              expected="the gradient of sum(out * w) for its weights, from one backward",
                              got=f"max difference {diff:.3g} (its backward ran {record['backwards'][i]} times)",
                              hint="each block's backward must run once per step" if twice else
                              "a checkpointed block must recompute exactly the forward it ran: the same input")
    if _maxdiff(got["x_grad"], ref["x_grad"]) > ATOL:
        raise CheckFailed(check, f"x's gradient differs from one process's ({where})", ranks=[0],
                          expected="x.grad of sum(out * w) without checkpointing",
                          got=f"max difference {_maxdiff(got['x_grad'], ref['x_grad']):.3g}",
                          hint="the blocks must run on x itself (not a detached copy) for its gradient to reach it")
    passed(check)


# --- the plan -----------------------------------------------------------------------------------------------------


def _moment(record: dict) -> str:
    at = record["peak_at"]
    if at is None or at >= len(record["journal"]):
        return "at the end of the step"
    op, index, _ = record["journal"][at]
    return {"F": f"before a forward of block {index} with gradients", "N": f"before a forward of block {index}",
            "B": f"before the backward of block {index}"}[op]


def check_checkpoint_plan(run_blocks, **config) -> None:
    """The peak of what the grader held fits the budget, each backward ran once, and the recomputation is the least
    any choice of checkpointed blocks needs to fit it."""
    check = "check_checkpoint_plan"
    seen, c, where = _seen(check, run_blocks, config)
    record, nbytes = seen["record"], seen["reference"]["bytes"]
    costs = [cost(c["rows"], c["d"], h) for h in c["hiddens"]]
    if any(n != 1 for n in record["backwards"]):
        bad = {i: n for i, n in enumerate(record["backwards"]) if n != 1}
        raise CheckFailed(check, f"some blocks' backward did not run exactly once ({where})", ranks=[0],
                          expected="one backward per block", got=", ".join(f"block {i}: {n}" for i, n in bad.items()),
                          hint="return the output of the last block with its graph; the harness runs the backward")
    budget = c["budget"]
    recomputed = [i for i, n in enumerate(record["forwards"]) if n > 1]
    if record["peak"] > budget:
        raise CheckFailed(check, f"the activations held at once exceed the budget ({where})", ranks=[0],
                          expected=f"at most {budget:,} bytes held by the blocks at any moment",
                          got=f"{record['peak']:,} bytes {_moment(record)}; recomputed: {recomputed or 'no block'}",
                          hint="a kept block holds its activations from its forward to its backward; a checkpointed "
                          "one holds them only from its recomputation to its backward, when the kept blocks before "
                          "it are still held: add up what is held at each moment")
    best, plans = best_plans(nbytes, costs, budget)
    spent = sum(costs[i] * (n - 1) for i, n in enumerate(record["forwards"]))
    if spent != best:
        raise CheckFailed(check, f"more recomputation than the budget needs ({where})", ranks=[0],
                          expected=f"{best:,} multiply-adds recomputed (a block's forward: 2 x rows x d x h); "
                          f"{min(len(p) for p in plans)} or more blocks checkpointed",
                          got=f"{spent:,}: blocks {recomputed} recomputed "
                          f"({', '.join(str(record['forwards'][i]) for i in recomputed)} forwards each)",
                          hint="try every choice of blocks to checkpoint: keep those whose peak fits the budget, and "
                          "of them the one whose recomputed blocks cost least; a block checkpointed needlessly, or "
                          "recomputed twice, costs its forward again")
    print(f"held at most {record['peak']:,} bytes of {budget:,} (everything kept: {sum(nbytes):,}), recomputing "
          f"blocks {recomputed}: {spent:,} multiply-adds")
    passed(check)


# --- the prediction -------------------------------------------------------------------------------------------------

REFUSED = ("graders.activation_memory's measurement is the grader's reference, refused to the answer: work out what "
           "each layer saves for its backward")


def _measure(rows: int, d: int, h: int) -> int:
    torch.manual_seed(0)
    return saved_bytes(Block(d, h), torch.randn(rows, d))[0]


def _drawn(count: int) -> list[tuple[int, int, int]]:
    draw = random.Random(os.urandom(8))
    return [(draw.randint(1, 64), draw.randint(2, 96), draw.randint(2, 256)) for _ in range(count)]


def check_saved_bytes(predict_saved_bytes, *, asked=((8, 16, 32), (4, 10, 7), (1, 3, 64)), drawn: int = 0) -> None:
    """``predict_saved_bytes(rows, d, h)`` equals the bytes a block saves for backward, measured by the grader."""
    check = "check_saved_bytes"
    checks.require_written(check, predict_saved_bytes=predict_saved_bytes)
    asked = list(asked) + _drawn(drawn)
    answers = predictions.ask(check, predict_saved_bytes, asked, refused=[saved_bytes, _measure, peak],
                              message=REFUSED, expected="predict_saved_bytes(rows, d, h) returns a number of bytes")
    for (rows, d, h), got in zip(asked, answers):
        want = _measure(rows, d, h)
        if got != want:
            raise CheckFailed(check, f"predict_saved_bytes({rows}, {d}, {h}) is wrong", expected=f"{want:,} bytes",
                              got=f"{got:,} bytes" if isinstance(got, (int, float)) else got,
                              hint="list the block's operations and what each keeps for its backward (a tensor "
                              "saved by two operations counts once; the parameters are not activations); float32 is "
                              "4 bytes an element")
    passed(check)
