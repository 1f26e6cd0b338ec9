"""Exercise 3's activation-memory notebook (graders.activation_memory): each check catches its class of mistake.

The checks are called directly with the notebook's reference, right answers in other styles (torch's reentrant
checkpoint and a dynamic search; an autograd Function of one's own that recomputes, inside a class), realistic
mistakes, and forgeries; then the notebook is graded with mistakes packed together.
"""

from __future__ import annotations

import itertools
import sys

import cloudpickle
import pytest
import submissions
import torch
from torch.utils.checkpoint import checkpoint

import graders.activation_memory.checks as am
from graders.activation_memory.blocks import Blocks, BlockServer, best_plans, cost, peak

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex3-syncbn-sharding", "activation_memory"
HIDDEN = [dict(rows=6, d=12, hiddens=(40, 24, 72, 56, 88), budget=9108, seed=1),
          dict(rows=10, d=8, hiddens=(16, 64, 32, 48, 24, 56, 40), budget=15092, seed=2)]
fails = submissions.fails


def _answer(cell: str, name: str, function: str, *edits: tuple[str, str]):
    return submissions.answer_function(A, NB, cell, function, name,
                                       {"torch": torch, "itertools": itertools, "checkpoint": checkpoint,
                                        "__name__": __name__}, *edits)


reference_run = _answer("am_run_blocks", "reference_run", "run_blocks")
reference_predict = _answer("am_predict", "reference_predict", "predict_saved_bytes")
#: every block checkpointed: within the budget, but everything recomputed
everything = _answer("am_run_blocks", "everything", "run_blocks", ("if i in plan else block(x)", "if True else block(x)"))
#: nothing checkpointed
nothing = _answer("am_run_blocks", "nothing", "run_blocks", ("if i in plan else block(x)", "if False else block(x)"))
#: the peak taken as what is held after the forward: the recomputation during backward forgotten
after_forward_only = _answer("am_run_blocks", "after_forward_only", "run_blocks",
                             ("return max([sum(kept)] + [sum(kept[:i]) + sizes[i] for i in plan])",
                              "return sum(kept)"))
#: the chosen blocks run without gradients and never recomputed
no_recompute = _answer("am_run_blocks", "no_recompute", "run_blocks", (
    "x = checkpoint(block, x, use_reentrant=False) if i in plan else block(x)",
    "if i in plan:\n            with torch.no_grad():\n                x = block(x)\n        else:\n"
    "            x = block(x)"))
#: Python's late-binding closure: every checkpointed block's recomputation runs the loop's last block
late_lambda = _answer("am_run_blocks", "late_lambda", "run_blocks", (
    "x = checkpoint(block, x, use_reentrant=False) if i in plan else block(x)",
    "x = checkpoint(lambda t: blocks[i](t), x, use_reentrant=False) if i in plan else block(x)"))
#: LayerNorm's mean and 1/std forgotten
no_statistics = _answer("am_predict", "no_statistics", "predict_saved_bytes", (" + 2 * rows", ""))


def reentrant_dynamic(blocks, x, budget):
    """torch's reentrant checkpoint; the plan by a search over subsets as bit masks, cheapest first."""
    rows, d = x.shape
    saved = [4 * rows * (2 * d + 2 * b.h + 2) for b in blocks]
    work = [2 * rows * d * b.h for b in blocks]
    best = None
    for mask in sorted(range(1 << len(blocks)), key=lambda m: sum(work[i] for i in range(len(blocks)) if m >> i & 1)):
        held, worst = 0, 0
        for i in range(len(blocks)):
            if mask >> i & 1:
                worst = max(worst, held + saved[i])
            else:
                held += saved[i]
        if max(worst, held) <= budget:
            best = mask
            break
    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=True) if best >> i & 1 else block(x)
    return x


class Recompute(torch.autograd.Function):
    """A checkpoint of one's own: forward without a graph, the block run again under grad in backward."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.save_for_backward(x)
        ctx.block = block
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(x.requires_grad)
            out = ctx.block(leaf)
        torch.autograd.backward(out, grad)
        return leaf.grad, None


class Planner:
    def __init__(self, blocks, rows, budget):
        self.blocks, self.budget = list(blocks), budget
        self.bytes = [4 * rows * (2 * blocks.d + 2 * b.h + 2) for b in blocks]
        self.cost = [b.h for b in blocks]  # proportional to the multiply-adds: rows and d are shared

    def fits(self, chosen):
        kept = [0 if i in chosen else n for i, n in enumerate(self.bytes)]
        return all(sum(kept[:i]) + self.bytes[i] <= self.budget for i in chosen) and sum(kept) <= self.budget

    def choose(self):
        options = [set(c) for r in range(len(self.blocks) + 1) for c in itertools.combinations(range(len(self.blocks)), r)]
        return min((c for c in options if self.fits(c)), key=lambda c: (sum(self.cost[i] for i in c), sorted(c)))


def function_class_style(blocks, x, budget):
    chosen = Planner(blocks, x.shape[0], budget).choose()
    for i, block in enumerate(blocks):
        x = Recompute.apply(x, block) if i in chosen else block(x)
    return x


def predict_by_layer(rows, d, h):
    """A table of what each layer saves, in elements."""
    saves = {"layernorm": rows * d + rows + rows, "up": rows * d, "gelu": rows * h, "down": rows * h}
    return sum(saves.values()) * torch.finfo(torch.float32).bits // 8


def predict_from_shapes(rows, d, h):
    """The saved tensors' shapes listed, their elements counted with torch."""
    shapes = [(rows, d), (rows, 1), (rows, 1), (rows, d), (rows, h), (rows, h)]
    return sum(torch.empty(s).numel() for s in shapes) * torch.empty(0).element_size()


def frees_without_recomputing(blocks, x, budget):
    """A forgery: each block's graph is dropped at once (its activations let go, the peak tiny), the output rebuilt
    to look differentiable."""
    out = x
    for block in blocks:
        out = block(out).detach()
    return out + 0 * x


def plans_with_the_graders_search(blocks, x, budget):
    """A forgery: the grader's own plan search, imported, picks the blocks."""
    from graders.activation_memory.blocks import best_plans

    rows, d = x.shape
    sizes = [4 * rows * (2 * d + 2 * b.h + 2) for b in blocks]
    plan = best_plans(sizes, [2 * rows * d * b.h for b in blocks], budget)[1][0]
    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if i in plan else block(x)
    return x


def calls_the_grader(rows, d, h):
    return am._measure(rows, d, h)


# --- the checks, called directly --------------------------------------------------------------------------------


@pytest.mark.parametrize("run", [reference_run, reentrant_dynamic, function_class_style], ids=lambda f: f.__name__)
def test_right_answers_pass_every_check_visible_and_hidden(run):
    for config in ({}, *HIDDEN):
        am.check_checkpoint_gradients(run, **config)
        am.check_checkpoint_plan(run, **config)


def test_right_predictions_pass_on_drawn_sizes():
    am.check_saved_bytes(reference_predict, drawn=40)
    am.check_saved_bytes(predict_by_layer, drawn=40)
    am.check_saved_bytes(predict_from_shapes, drawn=40)


def test_checkpointing_everything_fits_but_recomputes_too_much():
    am.check_checkpoint_gradients(everything)
    fails(am.check_checkpoint_plan, everything, "more recomputation than the budget needs", "53,248 multiply-adds",
          "blocks [0, 1, 2, 3, 4, 5] recomputed")


def test_checkpointing_nothing_exceeds_the_budget():
    am.check_checkpoint_gradients(nothing)
    fails(am.check_checkpoint_plan, nothing, "exceed the budget", "35,200 bytes before the backward of block 5",
          "at most 19,360 bytes", "recomputed: no block")


def test_a_plan_that_forgets_the_recomputation_exceeds_the_budget_during_backward():
    message = fails(am.check_checkpoint_plan, after_forward_only, "exceed the budget", "before the backward of block")
    assert "when the kept blocks before it are still held" in message
    am.check_checkpoint_gradients(after_forward_only)


def test_blocks_run_without_gradients_and_never_recomputed_lose_both():
    fails(am.check_checkpoint_gradients, no_recompute, "the gradient did not reach blocks [0, 1, 2, 3, 4]", "torch.no_grad()")
    fails(am.check_checkpoint_plan, no_recompute, "backward did not run exactly once", "block 0: 0")


def test_a_recomputation_that_runs_another_block_is_named():
    fails(am.check_checkpoint_gradients, late_lambda, "a call of block 5 came in its place",
          "the recomputation ran block 5 where block 4's forward was", "functools.partial")


def test_forgeries_are_caught():
    fails(am.check_checkpoint_gradients, frees_without_recomputing, "did not reach")
    fails(am.check_checkpoint_plan, frees_without_recomputing, "backward did not run exactly once")
    fails(am.check_saved_bytes, calls_the_grader, "refused to the answer")
    fails(am.check_checkpoint_plan, plans_with_the_graders_search, "peak rule and plan search are the grader's "
          "reference, refused to the answer")


def test_the_weights_counted_as_activations_are_a_wrong_prediction():
    def with_the_weights(rows, d, h):
        return reference_predict(rows, d, h) + 4 * (d * h + h * d)

    fails(am.check_saved_bytes, with_the_weights, "predict_saved_bytes(8, 16, 32) is wrong", "the parameters are not "
          "activations")


def test_a_forgotten_layernorm_statistic_is_a_wrong_prediction():
    fails(am.check_saved_bytes, no_statistics, "predict_saved_bytes(8, 16, 32) is wrong", "3,136 bytes", "3,072 bytes",
          "a tensor saved by two operations counts once")


def test_the_grader_holds_what_the_rank_graph_holds_whatever_the_checkpoint():
    """The held blocks' bookkeeping, directly: a kept call is held until its backward, a non-reentrant checkpoint's
    forward is let go at once and held again from its recomputation, a reentrant one's forward holds nothing."""
    d, rows, hiddens = 3, 2, (4, 5)
    with BlockServer(d, hiddens, rows) as server:
        blocks = Blocks(server.address, server.tokens[0], d, hiddens, rows)
        sizes = [4 * rows * (2 * d + 2 * h + 2) for h in hiddens]
        peaks = []
        for run in (lambda x: blocks[1](blocks[0](x)),
                    lambda x: blocks[1](checkpoint(blocks[0], x, use_reentrant=False)),
                    lambda x: blocks[1](checkpoint(blocks[0], x, use_reentrant=True))):
            server.peak = 0
            x = torch.randn(rows, d, requires_grad=True)
            run(x).sum().backward()
            with torch.no_grad():
                blocks[0](torch.zeros(rows, d))  # one more call, holding nothing: the last frees reach the grader
            peaks.append(server.record()["peak"])
        # kept: both blocks held before the first backward; checkpointed either way: one block at a time
        assert peaks == [sum(sizes), max(sizes), max(sizes)]
        record = server.record()
        assert record["forwards"] == [1 + 2 + 2 + 3, 3] and record["backwards"] == [3, 3]
        with pytest.raises(ValueError, match=r"takes a \(2, 3\) tensor"):
            blocks[0](torch.zeros(3, 3))
        with pytest.raises(TypeError, match="cannot be pickled"):
            cloudpickle.dumps(blocks[0])


def test_the_peak_model_is_the_grader_s_and_the_best_plan_is_unique_for_the_visible_case():
    sizes = [4 * 8 * (2 * 16 + 2 * h + 2) for h in am.VISIBLE["hiddens"]]
    costs = [cost(8, 16, h) for h in am.VISIBLE["hiddens"]]
    best, plans = best_plans(sizes, costs, am.VISIBLE["budget"])
    assert plans == [{1, 2, 4}] and best == 53248
    assert peak(sizes, set()) == 35200 > am.VISIBLE["budget"] >= peak(sizes, {1, 2, 4})
    for config in HIDDEN:  # each hidden budget has one best plan too, and needs some checkpointing
        sizes = [4 * config["rows"] * (2 * config["d"] + 2 * h + 2) for h in config["hiddens"]]
        costs = [cost(config["rows"], config["d"], h) for h in config["hiddens"]]
        assert len(best_plans(sizes, costs, config["budget"])[1]) == 1 and peak(sizes, set()) > config["budget"]


# --- the notebook: reference, untouched copy, wrong submissions ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    assert submissions.assert_reference_full_marks(A, NB).max_score == 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test
    assert report.max_score == 10
    assert all(t.message.startswith("FAILED check_") for t in report.tests), report.tests


WRONG = {
    "the recomputation forgotten in the peak": (
        [("am_run_blocks", "return max([sum(kept)] + [sum(kept[:i]) + sizes[i] for i in plan])", "return sum(kept)")],
        ["am_test_plan"], ["exceed the budget"]),
    "LayerNorm's statistics forgotten": (
        [("am_predict", " + 2 * rows", "")], ["am_test_bytes"], ["is wrong"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(WRONG), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    submissions.grade_packed(A, tmp_path, WRONG, group, notebook=NB)
