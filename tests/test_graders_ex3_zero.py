"""Exercise 3's sharded-optimizer notebook (graders.sharded_optimizer): each check catches its class of mistake.

The checks are called directly with the notebook's reference, right answers in other styles (an uneven
``tensor_split`` partition with owner broadcasts; a class whose partition is strided, every rank owning every
world_size-th element), realistic mistakes, and forgeries that try to look sharded without being so; then the
notebook is graded with mistakes packed together.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graders.sharded_optimizer.checks as so
from graders.sharded_optimizer.adam import AdamServer, ShardedAdam, draw, fetch_data, numel

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex3-syncbn-sharding", "sharded_optimizer"
HIDDEN = [dict(world_size=2, widths=(4, 9, 2), n_micro=3, rows=3, loss="smooth_l1", seed=1),
          dict(world_size=4, widths=(5, 6, 3), n_micro=2, rows=2, seed=2)]
fails = submissions.fails


def _answer(name: str, *edits: tuple[str, str]):
    return submissions.answer_function(A, NB, "so_zero_step", "zero_step", name,
                                       {"torch": torch, "dist": dist, "F": F, "__name__": __name__}, *edits)


reference_step = _answer("reference_step")
#: every rank adds and steps every element: plain data parallelism with Adam, nothing sharded
unsharded = _answer("unsharded", ("lo, hi = min(rank * size, n), min((rank + 1) * size, n)", "lo, hi = 0, n"),
                    ("        padded = torch.nn.functional.pad(vector, (0, size * world_size - n))\n"
                     "        piece = torch.empty(size)\n        dist.reduce_scatter_single(piece, padded)\n"
                     "        return piece[: hi - lo] / world_size",
                     "        dist.all_reduce(vector)\n        return vector / world_size"),
                    ("        gathered = torch.empty(size * world_size)\n"
                     "        dist.all_gather_single(gathered, torch.nn.functional.pad(new, (0, size - (hi - lo))))\n",
                     "        gathered = new\n"))
#: each rank writes back its own partition's new values only: the model is never made whole again
no_gather = _answer("no_gather", (
    "        gathered = torch.empty(size * world_size)\n"
    "        dist.all_gather_single(gathered, torch.nn.functional.pad(new, (0, size - (hi - lo))))\n",
    "        gathered = values.clone()\n        gathered[lo:hi] = new\n"))
#: the ranks' gradients summed, never divided by world_size (Adam's weights barely notice)
summed = _answer("summed", ("return piece[: hi - lo] / world_size", "return piece[: hi - lo]"))
#: each micro-batch's loss not divided by the number of micro-batches
micro_not_divided = _answer("micro_not_divided", ("(loss_fn(model(x), y) / len(micro_batches)).backward()",
                                                  "loss_fn(model(x), y).backward()"))
#: stage 2 run as stage 1: the whole gradient kept through the micro-batches, reduced once
stage2_reduces_once = _answer("stage2_reduces_once", ("if stage == 2:\n            model.zero_grad()", "if False:\n            pass"),
                              ("if stage == 2:\n            optimizer.add_grad", "if False:\n            optimizer.add_grad"),
                              ("    if stage == 1:\n        optimizer.add_grad", "    if True:\n        optimizer.add_grad"))
#: stage 1 run as stage 2: a reduction after every micro-batch
stage1_per_micro = _answer("stage1_per_micro", ("if stage == 2:\n            model.zero_grad()", "if True:\n            model.zero_grad()"),
                           ("if stage == 2:\n            optimizer.add_grad", "if True:\n            optimizer.add_grad"),
                           ("    if stage == 1:\n        optimizer.add_grad", "    if False:\n        optimizer.add_grad"))
#: stage 1 with stage 2's communication: each micro-batch's gradient reduced as it is done, summed, and handed to
#: the partition once (right values, and one add a step: only the collectives between the micro-batches show it)
stage1_reduces_each_micro = _answer(
    "stage1_reduces_each_micro",
    ("    model.zero_grad()\n    for x, y in micro_batches:\n        if stage == 2:\n            model.zero_grad()\n"
     "        (loss_fn(model(x), y) / len(micro_batches)).backward()\n",
     "    model.zero_grad()\n    total = torch.zeros(hi - lo)\n    for x, y in micro_batches:\n"
     "        model.zero_grad()\n        (loss_fn(model(x), y) / len(micro_batches)).backward()\n"
     "        total += my_share(flat_grad())\n"),
    ("    if stage == 1:\n        optimizer.add_grad(lo, my_share(flat_grad()))",
     "    if stage == 1:\n        optimizer.add_grad(lo, total)"))
#: stage 2 without zeroing .grad between the micro-batches: each hand-over holds the earlier micro-batches' too
stage2_keeps_grads = _answer("stage2_keeps_grads", ("if stage == 2:\n            model.zero_grad()",
                                                    "if False:\n            model.zero_grad()"))
#: no reduction at all: each rank hands its partition its own gradient
local_only = _answer("local_only", ("        dist.reduce_scatter_single(piece, padded)\n        return piece[: hi - lo] / world_size",
                                    "        return padded[lo:hi]"))


def tensor_split_style(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    """Uneven shares from torch.tensor_split (sizes differ by one), all-reduces, one broadcast per owner, the
    parameters updated through views of the flat vector."""
    params = [p for p in model.parameters()]
    flat = torch.nn.utils.parameters_to_vector(params)
    pieces = torch.tensor_split(torch.arange(flat.numel()), world_size)
    bounds = [int(p[0]) if len(p) else flat.numel() for p in pieces] + [flat.numel()]
    start, stop = bounds[rank], bounds[rank + 1]
    accumulated = torch.zeros(flat.numel())
    for x, y in micro_batches:
        grads = torch.autograd.grad(loss_fn(model(x), y) * (1.0 / len(micro_batches)), params)
        g = torch.cat([t.reshape(-1) for t in grads])
        if stage == 2:
            dist.all_reduce(g)
            optimizer.add_grad(start, g[start:stop] / world_size)
        else:
            accumulated += g
    if stage == 1:
        dist.all_reduce(accumulated)
        optimizer.add_grad(start, accumulated[start:stop] / world_size)
    flat[start:stop] = optimizer.step(start, flat[start:stop])
    for owner in range(world_size):
        part = flat[bounds[owner]:bounds[owner + 1]].contiguous()
        dist.broadcast(part, src=owner)
        flat[bounds[owner]:bounds[owner + 1]] = part
    torch.nn.utils.vector_to_parameters(flat, params)


class StridedZero:
    """A class whose partition is strided: rank r owns elements r, r + world_size, r + 2 * world_size, ...; the
    all-gather's pieces are interleaved back into place."""

    def __init__(self, model, optimizer, rank, world_size):
        self.model, self.optimizer, self.rank, self.world_size = model, optimizer, rank, world_size
        self.n = optimizer.numel
        self.mine = list(range(rank, self.n, world_size))
        self.width = -(-self.n // world_size)

    def flat_grad(self):
        return torch.cat([p.grad.flatten() for p in self.model.parameters()])

    def hand_over(self, grad):
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        for i in self.mine:
            self.optimizer.add_grad(i, grad[i:i + 1] / self.world_size)

    def step(self):
        values = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
        new = torch.stack([self.optimizer.step(i, values[i:i + 1])[0] for i in self.mine])
        padded = torch.zeros(self.width)
        padded[:len(new)] = new
        pieces = [torch.zeros(self.width) for _ in range(self.world_size)]
        dist.all_gather(pieces, padded)
        whole = torch.zeros(self.n)
        for r, piece in enumerate(pieces):
            count = len(range(r, self.n, self.world_size))
            whole[r::self.world_size] = piece[:count]
        torch.nn.utils.vector_to_parameters(whole, self.model.parameters())


def strided_class_style(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    zero = StridedZero(model, optimizer, rank, world_size)
    for p in model.parameters():
        p.grad = None
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) / len(micro_batches)
        loss.backward()
        if stage == 2:
            zero.hand_over(zero.flat_grad())
            model.zero_grad(set_to_none=False)
    if stage == 1:
        zero.hand_over(zero.flat_grad())
    zero.step()


def predict_by_counting(parameters, world_size, stage):
    """Bytes per parameter, piece by piece: what is sharded from this stage on is divided by the ranks."""
    pieces = [(2, 3), (2, 2), (12, 1)]  # (bytes a parameter, the first stage that shards it): weights, grads, state
    return sum(size * parameters / (world_size if stage >= first else 1) for size, first in pieces)


def predict_from_the_papers_table(parameters, world_size, stage):
    """The ZeRO paper's per-stage formulas, (2 + 2 + K) parameters with K = 12, written as a lookup."""
    k, psi, n = 12, parameters, world_size
    return [(2 + 2 + k) * psi, 2 * psi + 2 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (2 + 2 + k) * psi / n][stage]


def per_parameter(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    """Whole parameters dealt to the ranks, largest first, to the least loaded (as CS336's sharded optimizer does):
    right values and state on one rank each, but a share larger than even."""
    params = list(model.parameters())
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    load, owner = [0] * world_size, {}
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        r = load.index(min(load))
        owner[i], load[r] = r, load[r] + params[i].numel()
    model.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        if stage == 2:
            for i, p in enumerate(params):
                dist.all_reduce(p.grad)
                if owner[i] == rank:
                    optimizer.add_grad(offsets[i], p.grad.reshape(-1) / world_size)
            model.zero_grad()
    with torch.no_grad():
        for i, p in enumerate(params):
            if stage == 1:
                dist.all_reduce(p.grad)
                if owner[i] == rank:
                    optimizer.add_grad(offsets[i], p.grad.reshape(-1) / world_size)
            if owner[i] == rank:
                p.copy_(optimizer.step(offsets[i], p.reshape(-1)).reshape(p.shape))
            dist.broadcast(p, src=owner[i])


def guesses_the_update(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    """A forgery: the partition is asked for (so that the record looks sharded), but every rank updates the whole
    model itself with an Adam of its own (the learning rate guessed), so that nothing is gathered."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    size = -(-n // world_size)
    lo, hi = min(rank * size, n), min((rank + 1) * size, n)
    model.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grad)
    grad /= world_size
    optimizer.add_grad(lo, grad[lo:hi])
    with torch.no_grad():
        values = torch.cat([p.reshape(-1) for p in params])
        optimizer.step(lo, values[lo:hi])
        state = model.__dict__.setdefault("_adam", {"m": torch.zeros(n), "v": torch.zeros(n), "t": 0})
        state["t"] += 1
        state["m"].mul_(0.9).add_(grad, alpha=0.1)
        state["v"].mul_(0.999).addcmul_(grad, grad, value=0.001)
        m_hat, v_hat = state["m"] / (1 - 0.9 ** state["t"]), state["v"] / (1 - 0.999 ** state["t"])
        torch.nn.utils.vector_to_parameters(values - 3e-3 * m_hat / (v_hat.sqrt() + 1e-8), params)


def probes_a_peers_elements(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    """A forgery: rank 0 also steps one of rank 1's elements (to read its learning rate), then answers right."""
    if rank == 0:
        n = optimizer.numel
        first_of_rank_1 = -(-n // world_size)
        optimizer.step(first_of_rank_1, torch.zeros(1))
    reference_step(model, optimizer, micro_batches, loss_fn, rank, world_size, stage)


def as_rank_1_too(model, optimizer, micro_batches, loss_fn, rank, world_size, stage):
    """A forgery: rank 0 also connects as rank 1 (its token read from the harness's frame), to reach rank 1's data."""
    if rank == 0 and not hasattr(model, "_stolen"):
        frame = sys._getframe(1).f_locals
        model._stolen = fetch_data(ShardedAdam(frame["address"], frame["tokens"][1], optimizer.numel))
    reference_step(model, optimizer, micro_batches, loss_fn, rank, world_size, stage)


# --- the checks, called directly --------------------------------------------------------------------------------

CHECKS = (so.check_zero_weights, so.check_zero_state, so.check_zero_gradients)


@pytest.mark.parametrize("step", [reference_step, tensor_split_style, strided_class_style], ids=lambda f: f.__name__)
def test_right_answers_pass_every_check_visible_and_hidden(step):
    for config in ({}, *HIDDEN):
        for stage in (1, 2):
            for check in CHECKS:
                check(step, stage=stage, **config)


def test_plain_data_parallel_adam_loses_the_state_only():
    for stage in (1, 2):
        so.check_zero_weights(unsharded, stage=stage)
        so.check_zero_gradients(unsharded, stage=stage)
        fails(so.check_zero_state, unsharded, "every rank stepped every element", "[ranks 0, 1, 2]", "664 bytes",
              "at most 28 elements a rank", stage=stage)


def test_a_model_never_made_whole_again_loses_the_weights():
    message = fails(so.check_zero_weights, no_gather, "[rank 0]", "holds its own partition's update but not the other "
                    "ranks'", "elements 0-27", "gather every partition's new values")
    assert "step 1 of 3" in message
    so.check_zero_state(no_gather)
    so.check_zero_gradients(no_gather)  # step 1's gradients were right: judged up to the first wrong weights


def test_wrong_gradient_scales_pass_adams_weights_and_are_named_by_the_gradients():
    so.check_zero_weights(summed)  # Adam divides by the gradient's size: the weights hide the factor
    fails(so.check_zero_gradients, summed, "wrong gradient", "3 x the expected values",
          "summed over the ranks and not divided by world_size", "Adam hides a constant factor")
    so.check_zero_weights(micro_not_divided, stage=2)
    fails(so.check_zero_gradients, micro_not_divided, "2 x the expected values", "not divided by the 2 micro-batches",
          stage=2)


def test_stage_2_reduced_once_and_stage_1_reduced_per_micro_batch_are_named():
    for check in (so.check_zero_weights, so.check_zero_state):
        check(stage2_reduces_once, stage=2)
        check(stage1_per_micro, stage=1)
    so.check_zero_gradients(stage2_reduces_once, stage=1)
    fails(so.check_zero_gradients, stage2_reduces_once, "stage 2 hands a partition each micro-batch's gradient",
          "one for 2 micro-batches", "kept across the micro-batches", stage=2)
    so.check_zero_gradients(stage1_per_micro, stage=2)
    fails(so.check_zero_gradients, stage1_per_micro, "stage 1 hands a partition its gradient once a step",
          "one per micro-batch", "no communication", stage=1)


def test_stage_1_that_communicates_between_the_micro_batches_loses_the_gradients_only():
    for check in (so.check_zero_weights, so.check_zero_state):
        check(stage1_reduces_each_micro, stage=1)
    fails(so.check_zero_gradients, stage1_reduces_each_micro, "[rank 0]", "stage 1 communicates once a step",
          "between two micro-batches' forwards (step 1", "all_reduce of", "accumulate the micro-batches' gradients "
          "locally", stage=1)


def test_stage_2_that_keeps_the_earlier_micro_batches_gradients_is_named():
    fails(so.check_zero_gradients, stage2_keeps_grads, "after micro-batch 2 of step 1",
          "the sum of this and the earlier micro-batches' gradients", "zero it before each micro-batch's backward",
          stage=2)


def test_gradients_never_reduced_lose_weights_and_gradients():
    fails(so.check_zero_weights, local_only, "own partition was updated differently", "[rank 0]")
    fails(so.check_zero_gradients, local_only, "this rank's own gradient, not averaged over the ranks")
    so.check_zero_state(local_only)


def test_whole_parameters_dealt_to_ranks_are_more_than_an_even_share():
    for stage in (1, 2):
        so.check_zero_weights(per_parameter, stage=stage)
        so.check_zero_gradients(per_parameter, stage=stage)
    fails(so.check_zero_state, per_parameter, "more than an even share", "at most 28 elements", "48 elements",
          "cuts through parameters")


def test_forgeries_are_caught():
    fails(so.check_zero_weights, guesses_the_update, "[rank 0]", "one process's Adam")
    fails(so.check_zero_state, probes_a_peers_elements, "more than one rank", "ranks [0, 1]")
    message = fails(so.check_zero_weights, as_rank_1_too, "rank")
    assert "a second connection as rank 1" in message, message


def test_the_held_adam_keeps_each_ranks_state_apart_and_refuses_what_is_not_the_model():
    n = numel((2, 3, 1))
    draws = draw(2, (2, 3, 1), 1, 2, 0)
    with AdamServer(2, n, draws) as server:
        a, b = ShardedAdam(server.address, server.tokens[0], n), ShardedAdam(server.address, server.tokens[1], n)
        assert torch.equal(fetch_data(a), draws["data"][0]) and torch.equal(fetch_data(b), draws["data"][1])
        a.add_grad(0, torch.ones(3))
        new = a.step(0, torch.zeros(3))
        assert torch.allclose(new, -draws["lr"][:3], atol=1e-6)  # Adam's first step: -lr * sign(grad)
        assert torch.equal(b.step(0, torch.zeros(3)), torch.zeros(3))  # rank 1 added nothing: its own state
        with pytest.raises(RuntimeError, match=f"elements {n - 1} to {n} are not all in the model"):
            a.add_grad(n - 1, torch.ones(2))
        with pytest.raises(ValueError, match="1-D"):
            a.step(0, torch.zeros(1, 2))
        assert a.step(3, torch.zeros(0)).numel() == 0  # nothing asked
        with pytest.raises(TypeError, match="cannot be pickled"):
            cloudpickle.dumps(a)
        record = server.record()
        assert [(r, op, off) for r, op, off, _, _ in record["requests"]] == [(0, "G", 0), (0, "S", 0), (1, "S", 0)]
        assert "not all in the model" in record["refused_by"][0][0]


def test_the_memory_prediction_is_judged_by_stage():
    def stage_1_as_stage_3(parameters, world_size, stage):
        return 16 * parameters / world_size if stage else 16 * parameters

    fails(so.check_zero_memory, stage_1_as_stage_3, "predict_zero_memory(7_500_000_000, 64, 1) is wrong",
          "31,406,250,000 bytes", "that is stage 3's", "each rank still keeps all the bf16 weights")
    ok = submissions.answer(submissions.load(A, NB), "so_predict")
    namespace = {}
    exec(compile(ok, "<predict>", "exec"), namespace)  # noqa: S102 - the course's own reference
    so.check_zero_memory(namespace["predict_zero_memory"], drawn=60)
    so.check_zero_memory(predict_by_counting, drawn=60)
    so.check_zero_memory(predict_from_the_papers_table, drawn=60)

    def every_stage_shards_the_state_only(parameters, world_size, stage):  # stages 2 and 3 forgotten
        return 4 * parameters + 12 * parameters / world_size if stage else 16 * parameters

    fails(so.check_zero_memory, every_stage_shards_the_state_only, "predict_zero_memory(7_500_000_000, 64, 2) is wrong",
          "that is stage 1's", "shards the gradients as well")


def test_the_formula_is_refused_to_the_prediction():
    from graders.sharded_optimizer.checks import zero_memory

    def calls_the_grader(parameters, world_size, stage):
        return zero_memory(parameters, world_size, stage)

    fails(so.check_zero_memory, calls_the_grader, "refused to the answer")


# --- the notebook: reference, untouched copy, wrong submissions ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    assert submissions.assert_reference_full_marks(A, NB).max_score == 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test
    assert report.max_score == 20
    assert all(t.message.startswith("FAILED check_") for t in report.tests), report.tests


WRONG = {
    "stage 2 reduced once a step": (
        [("so_zero_step", "if stage == 2:\n            model.zero_grad()", "if False:\n            pass"),
         ("so_zero_step", "if stage == 2:\n            optimizer.add_grad", "if False:\n            optimizer.add_grad"),
         ("so_zero_step", "    if stage == 1:\n        optimizer.add_grad", "    if True:\n        optimizer.add_grad")],
        ["so_test_gradients_2"], ["kept across the micro-batches"]),
    "the memory of stage 2 without the gradients' share": (
        [("so_predict", '2: ("grads", "state")', '2: ("state",)')],
        ["so_test_memory"], ["predict_zero_memory(7_500_000_000, 64, 2) is wrong"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(WRONG), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    submissions.grade_packed(A, tmp_path, WRONG, group, notebook=NB)
