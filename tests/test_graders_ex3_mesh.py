"""Exercise 3's two-dimensional notebook (graders.two_dimensions): each check catches its class of mistake.

The checks are called directly with the notebook's reference, right answers in other styles (torch's DeviceMesh
with an autograd Function for the row's sum; a class over ``new_subgroups_by_enumeration``), the collectives run on
the wrong ranks or counted twice, and a forgery; then the notebook is graded with mistakes packed together.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.distributed.nn.functional
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import graders.two_dimensions.checks as td
from graders.two_dimensions.shards import Shard

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex3-syncbn-sharding", "two_dimensions"
HIDDEN = [dict(dp=1, tp=4, d_in=4, h=8, d_out=2, rows=3, seed=1), dict(dp=4, tp=1, d_in=3, h=6, d_out=2, rows=2, seed=2),
          dict(dp=3, tp=2, d_in=4, h=6, d_out=3, rows=3, seed=3)]
CHECKS = (td.check_mesh_losses, td.check_mesh_gradients, td.check_mesh_training)
fails = submissions.fails


def _answer(name: str, *edits: tuple[str, str]):
    return submissions.answer_function(A, NB, "td_train", "train_on_mesh", name,
                                       {"torch": torch, "dist": dist, "F": F, "init_device_mesh": init_device_mesh,
                                        "__name__": __name__}, *edits)


reference_train = _answer("reference_train")
#: the row's sum through torch's differentiable all-reduce: its backward sums the gradient over the row again
twice_through_the_row = _answer("twice_through_the_row", (
    "        total = partial.detach().clone()\n        dist.all_reduce(total, group=row)  # the model's output: the "
    "row's partial outputs summed\n        out = partial + (total - partial.detach())",
    "        out = torch.distributed.nn.functional.all_reduce(partial, group=row)"))
#: each replica steps with its own gradient
own_replica = _answer("own_replica", ("        dist.all_reduce(grad, group=column)", "        pass"))
#: the column's gradients summed, not averaged
summed_column = _answer("summed_column", ("shard.step(grad / dp)", "shard.step(grad)"))
#: the gradients averaged over the whole world
whole_world = _answer("whole_world", ("dist.all_reduce(grad, group=column)", "dist.all_reduce(grad)"),
                      ("shard.step(grad / dp)", "shard.step(grad / (dp * tp))"))
#: the partial outputs summed along the column instead of the row
wrong_group_forward = _answer("wrong_group_forward", ("dist.all_reduce(total, group=row)", "dist.all_reduce(total, group=column)"))
#: the gradients averaged along the row instead of the column
wrong_group_backward = _answer("wrong_group_backward", ("dist.all_reduce(grad, group=column)", "dist.all_reduce(grad, group=row)"),
                               ("shard.step(grad / dp)", "shard.step(grad / tp)"))


class _RowSum(torch.autograd.Function):
    """The sum of the row's partial outputs; its backward hands the output's gradient to this shard unchanged."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def device_mesh_style(shard, batches, dp, tp, rank):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    losses = []
    for x, y in batches:
        loss = F.mse_loss(_RowSum.apply(shard(x), mesh.get_group("tp")), y)
        loss.backward()
        grad = shard.grad()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
        shard.step(grad.div(mesh.size(0)))
        losses.append(loss.detach())
    return losses


class Grid:
    """Rows and columns from dist.new_subgroups_by_enumeration; a hook-free sum through a detached correction."""

    def __init__(self, dp, tp):
        self.row, _ = dist.new_subgroups_by_enumeration([list(range(d * tp, d * tp + tp)) for d in range(dp)])
        self.column, _ = dist.new_subgroups_by_enumeration([list(range(t, dp * tp, tp)) for t in range(tp)])
        self.replicas = dp

    def output(self, partial):
        others = partial.detach().clone()
        dist.all_reduce(others, group=self.row)
        return partial + (others - partial).detach()

    def average(self, grad):
        dist.all_reduce(grad, group=self.column)
        return grad / self.replicas


def class_style(shard, batches, dp, tp, rank):
    grid = Grid(dp, tp)
    losses = []
    for x, y in batches:
        loss = ((grid.output(shard(x)) - y) ** 2).mean()
        loss.backward()
        shard.step(grid.average(shard.grad()))
        losses.append(float(loss))
    return losses


def as_rank_1_too(shard, batches, dp, tp, rank):
    """A forgery: rank 0 also connects as rank 1 (its token read from the harness's frame)."""
    if rank == 0:
        frame = sys._getframe(1).f_locals
        Shard(frame["address"], frame["tokens"][1], 1, dp, tp, frame["shape"]).grad()
    return reference_train(shard, batches, dp, tp, rank)


def predict_with_dtensor_objects(dp, tp, d_in, h, d_out, rows):
    """torch's own placement objects; the counts from the shapes of the slices."""
    from torch.distributed.tensor import Replicate, Shard

    up, down = torch.empty(h // tp, d_in), torch.empty(d_out, h // tp)
    return {"placements": {"up.weight": (Replicate(), Shard(0)), "up.bias": (Replicate(), Shard(0)),
                           "down.weight": (Replicate(), Shard(1))},
            "row_values": torch.empty(rows, d_out).numel(),
            "column_values": up.numel() + h // tp + down.numel()}


def predict_by_dimension(dp, tp, d_in, h, d_out, rows):
    """Placements from the dimension each weight's hidden features lie along; counts by hand."""
    hidden_dim = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    placements = {name: ["Replicate()", "Shard(" + str(dim) + ")"] for name, dim in hidden_dim.items()}
    slice_ = h // tp
    return {"placements": placements, "row_values": rows * d_out, "column_values": slice_ * d_in + slice_ * (1 + d_out)}


def predict_nothing_on_one_rank(dp, tp, d_in, h, d_out, rows):
    """Right too: a dimension of one rank all-reduces nothing (0), and its one slice is the whole tensor
    (Replicate); the drawn cases hold 1 x tp and dp x 1 meshes."""
    along_tp = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    placements = {name: ["Replicate()", "Replicate()" if tp == 1 else f"Shard({dim})"]
                  for name, dim in along_tp.items()}
    slice_ = h // tp
    return {"placements": placements, "row_values": rows * d_out if tp > 1 else 0,
            "column_values": slice_ * (d_in + 1 + d_out) if dp > 1 else 0}


# --- the checks, called directly --------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [reference_train, device_mesh_style, class_style], ids=lambda f: f.__name__)
def test_right_answers_pass_every_check_on_every_mesh(train):
    for config in ({}, *HIDDEN):
        for check in CHECKS:
            check(train, **config)


def test_the_rows_sum_differentiated_by_torch_counts_the_gradient_once_per_rank_of_the_row():
    td.check_mesh_losses(twice_through_the_row)  # step 1 right; later steps are not judged once the weights differ
    fails(td.check_mesh_gradients, twice_through_the_row, "2 x the expected", "summed over the row again")
    fails(td.check_mesh_gradients, twice_through_the_row, "4 x the expected", "summed over the row again",
          **HIDDEN[0])  # a single row of 4: nothing else gives 4 x
    fails(td.check_mesh_training, twice_through_the_row, "after step 1", "differ from the one-process model's")


def test_gradients_not_averaged_over_the_column_are_named():
    td.check_mesh_losses(own_replica)
    fails(td.check_mesh_gradients, own_replica, "its own replica's gradient", "ranks [0, 2]")
    fails(td.check_mesh_gradients, summed_column, "2 x the expected: summed over the column")
    fails(td.check_mesh_training, own_replica, "after step 1")


def test_collectives_on_the_wrong_ranks_are_named():
    fails(td.check_mesh_gradients, whole_world, "every rank's gradient averaged: the all-reduce ran on the whole world")
    fails(td.check_mesh_gradients, wrong_group_backward, "the all-reduce ran on the wrong group")
    fails(td.check_mesh_losses, wrong_group_forward, "summed over the data-parallel column instead of the row",
          "ranks [0, 1]")


def test_a_second_connection_to_another_ranks_shard_is_refused():
    message = fails(td.check_mesh_training, as_rank_1_too, "rank")
    assert "a second connection as rank 1" in message, message


def test_predictions_of_placements_and_traffic():
    reference_predict = submissions.answer_function(A, NB, "td_predict", "predict_mesh", "reference_predict",
                                                    {"torch": torch, "__name__": __name__})
    for predict in (reference_predict, predict_with_dtensor_objects, predict_by_dimension):
        td.check_mesh_prediction(predict, drawn=30)
    td.check_mesh_prediction(predict_nothing_on_one_rank, asked=((2, 2, 5, 8, 3, 4), (1, 4, 4, 8, 2, 3),
                                                                 (4, 1, 3, 6, 2, 2), (1, 1, 2, 4, 3, 5)), drawn=30)
    weight_as_stored = submissions.answer_function(A, NB, "td_predict", "predict_mesh", "weight_as_stored",
                                                   {"torch": torch, "__name__": __name__},
                                                   ('"up.weight": ["Replicate()", "Shard(0)"]',
                                                    '"up.weight": ["Replicate()", "Shard(1)"]'))
    fails(td.check_mesh_prediction, weight_as_stored, "the placements of up.weight are wrong", "Shard(0)",
          "which dimension of the weight does a shard cut")
    per_row = submissions.answer_function(A, NB, "td_predict", "predict_mesh", "per_row",
                                          {"torch": torch, "__name__": __name__},
                                          ('"row_values": rows * d_out', '"row_values": d_out'))
    fails(td.check_mesh_prediction, per_row, "along the row (the partial outputs) are wrong", "expected: 12")

    def calls_the_grader(*case):
        return td.mesh_truth(*case)

    fails(td.check_mesh_prediction, calls_the_grader, "refused to the answer")


# --- the notebook: reference, untouched copy, wrong submissions ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    assert submissions.assert_reference_full_marks(A, NB).max_score == 13


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test
    assert report.max_score == 13
    assert all(t.message.startswith("FAILED check_") for t in report.tests), report.tests


WRONG = {
    "the column's gradients summed": (
        [("td_train", "shard.step(grad / dp)", "shard.step(grad)")],
        ["td_test_gradients", "td_test_training"], ["summed over the column"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(WRONG), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    submissions.grade_packed(A, tmp_path, WRONG, group, notebook=NB)
