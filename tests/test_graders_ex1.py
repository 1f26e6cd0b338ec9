"""Exercise 1's checks: each catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with correct and wrong functions directly. Wrong
submissions are the source notebook with one answer edited, graded in this
process; each must lose exactly the intended test cell's points.
"""

from __future__ import annotations

import re
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graders.ex1 as ex1
from course.checks import TIMEOUT_ENV

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex1-parallelism"
HANG_TIMEOUT = 15  # the check timeout the hang tests use (DDP_COURSE_CHECK_TIMEOUT)


# --- student functions, right and wrong --------------------------------------------------------


def shard_batch(batch, rank, world_size):
    base, extra = divmod(len(batch), world_size)
    start = rank * base + min(rank, extra)
    return batch[start:start + base + (1 if rank < extra else 0)]


def shard_strided(batch, rank, world_size):  # a different correct answer
    return batch[rank::world_size]


def shard_drop_remainder(batch, rank, world_size):
    n = len(batch) // world_size
    return batch[rank * n:(rank + 1) * n]


def shard_overlap(batch, rank, world_size):
    n = len(batch) // world_size
    return batch[rank:rank + n]


def shard_last_takes_rest(batch, rank, world_size):
    n = len(batch) // world_size
    return batch[rank * n:len(batch) if rank == world_size - 1 else (rank + 1) * n]


def shard_stub(batch, rank, world_size):
    """As nbgrader releases it."""
    # YOUR CODE HERE
    raise NotImplementedError()


def average_gradients(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def average_no_divide(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def average_no_all_reduce(model, world_size):
    for p in model.parameters():
        p.grad /= world_size


def average_by_two(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= 2


def average_params_not_grads(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.data, op=dist.ReduceOp.SUM)
        p.data /= world_size


def two_stage_step(rank, stage, x, y, hidden_shape):
    if rank == 0:
        act = stage(x)
        dist.send(act.detach(), dst=1)
        grad = torch.empty_like(act)
        dist.recv(grad, src=1)
        act.backward(grad)
        return None
    act = torch.empty(hidden_shape, device=y.device)
    dist.recv(act, src=0)
    act.requires_grad_()
    loss = F.mse_loss(stage(act), y)
    loss.backward()
    dist.send(act.grad, dst=0)
    return loss.detach()


def two_stage_no_gradient_back(rank, stage, x, y, hidden_shape):
    if rank == 0:
        dist.send(stage(x).detach(), dst=1)
        return None
    act = torch.empty(hidden_shape)
    dist.recv(act, src=0)
    loss = F.mse_loss(stage(act), y)
    loss.backward()
    return loss.item()


def two_stage_wrong_loss(rank, stage, x, y, hidden_shape):
    if rank == 0:
        act = stage(x)
        dist.send(act.detach(), dst=1)
        grad = torch.empty_like(act)
        dist.recv(grad, src=1)
        act.backward(grad)
        return None
    act = torch.empty(hidden_shape)
    dist.recv(act, src=0)
    act.requires_grad_()
    loss = F.mse_loss(stage(act), y, reduction="sum")
    loss.backward()
    dist.send(act.grad, dst=0)
    return loss.detach()


def two_stage_returns_nothing(rank, stage, x, y, hidden_shape):
    two_stage_step(rank, stage, x, y, hidden_shape)


fails = submissions.fails


# --- unit tests of the checks ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_shards():
    ex1.check_shards(shard_batch)
    ex1.check_shards(shard_strided, world_sizes=(4,), batch_sizes=(16, 10, 13))
    ex1.check_shards(shard_last_takes_rest)  # covering and disjoint; balance is check_shard_sizes'
    fails(ex1.check_shards, shard_drop_remainder, "on no rank", "remainder")
    fails(ex1.check_shards, shard_overlap, "overlap", "rank")
    fails(ex1.check_shards, shard_stub, "not written yet")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_shard_sizes():
    ex1.check_shard_sizes(shard_batch)
    ex1.check_shard_sizes(shard_strided)
    ex1.check_shard_sizes(shard_drop_remainder)  # balanced (though not covering: check_shards' job)
    fails(ex1.check_shard_sizes, shard_last_takes_rest, "unbalanced", "[2, 2, 2, 4]", "[ranks 0, 1, 2]")
    fails(ex1.check_shard_sizes, lambda batch, rank, world_size: batch.chunk(world_size)[rank], "[4, 4, 2]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_average_gradients():
    ex1.check_average_gradients(average_gradients)
    ex1.check_average_gradients(average_gradients, world_sizes=(4,), seed=1, n=16)
    fails(ex1.check_average_gradients, average_no_divide, "SUM", "divide each gradient by world_size", "[rank 0]")
    fails(ex1.check_average_gradients, average_no_all_reduce, "never all-reduced")
    fails(ex1.check_average_gradients, average_params_not_grads, "unchanged", "all_reduce every p.grad")
    fails(ex1.check_average_gradients, average_by_two, "1.5 x the average", "world_size=3", "hard-code")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_two_stage():
    ex1.check_two_stage(two_stage_step)
    ex1.check_two_stage(two_stage_step, seed=1, dims=((6, 3, 5, 4),))
    fails(ex1.check_two_stage, two_stage_no_gradient_back, "stage 0 has no gradients", "[rank 0]", "backward(grad)")
    fails(ex1.check_two_stage, two_stage_wrong_loss, "loss on rank 1 differs", "mse_loss")
    fails(ex1.check_two_stage, two_stage_returns_nothing, "rank 1 returned None")


# --- wrong submissions, graded as notebooks -------------------------------------------------------


def grade_with(tmp_path, grade_id, old, new):
    return submissions.grade_edited(A, tmp_path, (grade_id, old, new))


WRONG = {
    # name: (answer cell, old text, new text, the test cell that must fail, words its message must contain)
    "no division by world_size": ("ex1_average_gradients", "            p.grad /= world_size\n", "",
                                  "ex1_test_average_gradients", ["SUM", "divide"]),
    "no all_reduce": ("ex1_average_gradients", "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)", "pass",
                      "ex1_test_average_gradients", ["never all-reduced"]),
    "overlapping shards": ("ex1_shard_batch", "start = rank * base + min(rank, extra)", "start = rank",
                           "ex1_test_shards", ["overlap"]),
    "shards drop the remainder": ("ex1_shard_batch", "size = base + (1 if rank < extra else 0)", "size = base",
                                  "ex1_test_shards", ["on no rank", "remainder"]),
    "tensor.chunk (unbalanced)": ("ex1_shard_batch", "return batch[start:start + size]",
                                  "return batch.chunk(world_size)[rank]", "ex1_test_shard_sizes", ["unbalanced"]),
    "stage output detached": ("ex1_two_stage_step", "act = stage(x)\n", "act = stage(x).detach()\n",
                              "ex1_test_two_stage", ["detached"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_submission_loses_exactly_its_test(tmp_path, name):
    grade_id, old, new, failing, words = WRONG[name]
    submissions.assert_loses_exactly(grade_with(tmp_path, grade_id, old, new), A, [failing], words)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_send_recv_deadlock_is_graded_within_the_check_timeout(tmp_path, monkeypatch):
    """Both ranks receive first: a real deadlock, ended by the check's deadline (bound: timeout + 60 s)."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    report = grade_with(tmp_path, "ex1_two_stage_step",
                        "        dist.send(act.detach(), dst=1)  # activations forward\n"
                        "        grad = torch.empty_like(act)\n"
                        "        dist.recv(grad, src=1)  # their gradient comes back\n",
                        "        grad = torch.empty_like(act)\n"
                        "        dist.recv(grad, src=1)  # waits for rank 1, which waits for us\n"
                        "        dist.send(act.detach(), dst=1)\n")
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex1_test_two_stage")
    message = submissions.messages(report)["ex1_test_two_stage"]
    assert f"did not finish within {HANG_TIMEOUT} s" in message and "ranks 0, 1" in message
    assert "send and recv must pair up" in message and "rank 0 first SENDS" in message
    assert seconds < HANG_TIMEOUT + 60, f"grading took {seconds:.0f} s"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_endless_loop_is_graded_within_the_check_timeout(tmp_path, monkeypatch):
    """average_gradients loops forever (all ranks in step): stopped at the check's deadline."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    nb = submissions.replace_answer(submissions.load(A), "ex1_average_gradients", '''
def average_gradients(model, world_size):
    params = list(model.parameters())
    i = 0
    while i < len(params):  # forgot i += 1
        dist.all_reduce(params[i].grad, op=dist.ReduceOp.SUM)
        params[i].grad /= world_size
''')
    start = time.monotonic()
    report = submissions.grade(submissions.write(nb, tmp_path, A))
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex1_test_average_gradients")
    message = submissions.messages(report)["ex1_test_average_gradients"]
    assert f"did not finish within {HANG_TIMEOUT} s" in message
    # where each rank was: the student's own loop, by cell and line; never the grader's frames or paths
    assert re.search(r"Cell In\[\d+\], line \d+ in average_gradients", message), message
    assert not any(p in message for p in ("/course/", "graders/", "<frozen", "zygote", "verifier")), message
    assert seconds < HANG_TIMEOUT + 60, f"grading took {seconds:.0f} s"
