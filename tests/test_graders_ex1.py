"""Exercise 1's checks: each catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with correct and wrong functions directly. Wrong
submissions are the source notebook with one answer edited, graded in this
process; each must lose exactly the intended test cell's points.
"""

from __future__ import annotations

import copy
import re
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graders.parallelism.checks as ex1
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


def shard_tensor_split(batch, rank, world_size):  # another correct style: torch's own balanced split
    return torch.tensor_split(batch, world_size)[rank]


def shard_numpy_indices(batch, rank, world_size):  # another: numpy's array_split of the row numbers
    import numpy as np

    rows = np.array_split(np.arange(len(batch)), world_size)[rank]
    return batch[torch.as_tensor(rows, dtype=torch.long)]


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


def average_gradients(model, n_local):
    rows = torch.tensor(float(n_local))
    dist.all_reduce(rows)
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= rows


def average_weights_first(model, n_local):  # another correct style: weights all-gathered, one flat all-reduce
    counts = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([float(n_local)]))
    share = n_local / float(sum(counts))
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads]) * share
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def average_one_buffer(model, n_local):  # another correct style: grads and row count in one all-reduce
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) * n_local for g in grads] + [torch.tensor([float(n_local)])])
    dist.all_reduce(flat)
    flat = flat[:-1] / flat[-1]
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def average_plain_mean(model, n_local):  # the equal-shard recipe: wrong when the shards differ
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def average_no_divide(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def average_no_all_reduce(model, n_local):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def average_params_not_grads(model, n_local):
    for p in model.parameters():
        dist.all_reduce(p.data, op=dist.ReduceOp.SUM)
        p.data /= dist.get_world_size()


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


def two_stage_autograd_grad(rank, stage, x, y, hidden_shape):
    """Another correct style: non-blocking point-to-point, and torch.autograd.grad on the last stage (the input's
    gradient and the parameters' in one call, written into .grad by hand)."""
    if rank == 0:
        out = stage(x)
        dist.isend(out.detach().contiguous(), dst=1).wait()
        grad_out = torch.zeros_like(out)
        dist.irecv(grad_out, src=1).wait()
        out.backward(gradient=grad_out)
        return None
    act = torch.zeros(hidden_shape, device=y.device, requires_grad=True)
    with torch.no_grad():
        dist.irecv(act, src=0).wait()
    loss = F.mse_loss(stage(act), y)
    params = list(stage.parameters())
    grad_act, *grad_params = torch.autograd.grad(loss, [act, *params])
    for p, g in zip(params, grad_params):
        p.grad = g
    dist.isend(grad_act, dst=0).wait()
    return float(loss)


def two_stage_grad_of_a_plain_buffer(rank, stage, x, y, hidden_shape):
    """Wrong on rank 1: the received activations never require grad, and autograd.grad is asked for theirs."""
    if rank == 0:
        return two_stage_autograd_grad(rank, stage, x, y, hidden_shape)
    act = torch.zeros(hidden_shape, device=y.device)
    dist.irecv(act, src=0).wait()
    loss = F.mse_loss(stage(act), y)
    params = list(stage.parameters())
    grad_act, *grad_params = torch.autograd.grad(loss, [act, *params])
    dist.isend(grad_act, dst=0).wait()
    return float(loss)


class Pipe:
    """Another correct style: a helper that moves tensors between the two stages with batched P2P ops."""

    def __init__(self, peer):
        self.peer = peer

    def send(self, tensor):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), self.peer)]):
            work.wait()

    def recv(self, like):
        buffer = torch.empty_like(like)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, self.peer)]):
            work.wait()
        return buffer


def two_stage_pipe(rank, stage, x, y, hidden_shape):
    pipe = Pipe(1 - rank)
    if rank == 0:
        out = stage(x)
        pipe.send(out.detach())
        out.backward(pipe.recv(out))
        return None
    act = pipe.recv(torch.empty(hidden_shape, device=y.device)).requires_grad_()
    loss = F.mse_loss(stage(act), y)
    loss.backward()
    pipe.send(act.grad)
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
def shard_like_the_sampler(batch, rank, world_size):
    """Wrong here: DistributedSampler's rule (strided, the batch padded with its first rows to a multiple of
    world_size), so a row lands on two ranks."""
    n = len(batch)
    total = -(-n // world_size) * world_size
    order = (list(range(n)) * 2)[:total]
    return batch[order[rank:total:world_size]]


def test_check_shards():
    ex1.check_shards(shard_batch)
    ex1.check_shards(shard_strided, world_sizes=(4,), batch_sizes=(16, 10, 13))
    ex1.check_shards(shard_last_takes_rest)  # covering and disjoint; balance is check_shard_sizes'
    ex1.check_shards(shard_tensor_split)
    ex1.check_shards(shard_numpy_indices, world_sizes=(3,), batch_sizes=(7, 2))
    fails(ex1.check_shards, shard_drop_remainder, "on no rank", "remainder")
    fails(ex1.check_shards, shard_overlap, "overlap", "rank")
    fails(ex1.check_shards, shard_like_the_sampler, "overlap", "as DistributedSampler pads", world_sizes=(3,),
          batch_sizes=(10,))
    fails(ex1.check_shards, shard_stub, "not written yet")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_shard_sizes():
    ex1.check_shard_sizes(shard_batch)
    ex1.check_shard_sizes(shard_strided)
    ex1.check_shard_sizes(shard_tensor_split)
    ex1.check_shard_sizes(shard_numpy_indices)
    ex1.check_shard_sizes(shard_drop_remainder)  # balanced (though not covering: check_shards' job)
    fails(ex1.check_shard_sizes, shard_last_takes_rest, "unbalanced", "[2, 2, 2, 4]", "[ranks 0, 1, 2]")
    fails(ex1.check_shard_sizes, lambda batch, rank, world_size: batch.chunk(world_size)[rank], "[4, 4, 2]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_average_gradients():
    ex1.check_average_gradients(average_gradients)
    ex1.check_average_gradients(average_weights_first, world_sizes=(4,), seed=1, n=13)
    ex1.check_average_gradients(average_one_buffer, world_sizes=(3,), seed=2, n=11)
    fails(ex1.check_average_gradients, average_plain_mean, "plain mean", "weigh each rank by its number of rows")
    fails(ex1.check_average_gradients, average_no_divide, "row-weighted SUM", "divide", "[rank 0]")
    fails(ex1.check_average_gradients, average_no_all_reduce, "never all-reduced")
    fails(ex1.check_average_gradients, average_params_not_grads, "unchanged")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_two_stage():
    ex1.check_two_stage(two_stage_step)
    ex1.check_two_stage(two_stage_step, seed=1, dims=((6, 3, 5, 4),))
    ex1.check_two_stage(two_stage_autograd_grad)
    ex1.check_two_stage(two_stage_pipe, seed=1, dims=((6, 3, 5, 4),))
    fails(ex1.check_two_stage, two_stage_no_gradient_back, "stage 0 has no gradients", "[rank 0]", "backward(grad)")
    fails(ex1.check_two_stage, two_stage_wrong_loss, "loss on rank 1 differs", "mse_loss")
    fails(ex1.check_two_stage, two_stage_returns_nothing, "rank 1 returned None")
    fails(ex1.check_two_stage, two_stage_grad_of_a_plain_buffer, "does not require grad", "on rank 1, call "
          "requires_grad_() on the received activations")


# --- wrong submissions, graded as notebooks -------------------------------------------------------


def grade_with(tmp_path, grade_id, old, new):
    return submissions.grade_edited(A, tmp_path, (grade_id, old, new))


WRONG = {
    # name: (answer cell, old text, new text, the test cell that must fail, words its message must contain)
    "no division by the total rows": ("ex1_average_gradients", "            p.grad /= rows\n", "",
                                      "ex1_test_average_gradients", ["SUM", "divide"]),
    "overlapping shards": ("ex1_shard_batch", "start = rank * base + min(rank, extra)", "start = rank",
                           "ex1_test_shards", ["overlap"]),
    "shards drop the remainder": ("ex1_shard_batch", "size = base + (1 if rank < extra else 0)", "size = base",
                                  "ex1_test_shards", ["on no rank", "remainder"]),
    "tensor.chunk (unbalanced)": ("ex1_shard_batch", "return batch[start:start + size]",
                                  "return batch.chunk(world_size)[rank]", "ex1_test_shard_sizes", ["unbalanced"]),
    "TP: bias added before the sum": ("ex1_tensor_parallel", "SumOverRanks.apply(h @ self.weight.T) + self.bias",
                                      "SumOverRanks.apply(h @ self.weight.T + self.bias)", "ex1_test_tensor_parallel",
                                      ["bias was added on every rank"]),
    "TP: the sum all-reduces its gradient too, divided": (
        "ex1_tensor_parallel", "        return grad\n",
        "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad / dist.get_world_size()\n",
        "ex1_test_tensor_parallel_collectives", ["backward also all-reduced the output's gradient"]),
    "TP: no all-reduce of the input's gradient": (
        "ex1_tensor_parallel", "F.linear(CopyToParallel.apply(x), self.weight, self.bias)",
        "F.linear(x, self.weight, self.bias)", ["ex1_test_tensor_parallel", "ex1_test_tensor_parallel_collectives"],
        ["only this rank's part"]),
    "stage output detached": ("ex1_two_stage_step", "hidden = stage(x)\n", "hidden = stage(x).detach()\n",
                              "ex1_test_two_stage", ["detached"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: ([(gid, old, new)], failing if isinstance(failing, list) else [failing], words)
            for name, (gid, old, new, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_send_recv_deadlock_is_graded_within_the_check_timeout(tmp_path, monkeypatch):
    """Both ranks receive first: a real deadlock, which the stall watch names (every rank idle in recv) within
    seconds, long before the check's deadline."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    report = grade_with(tmp_path, "ex1_two_stage_step",
                        "        dist.send(hidden.detach(), dst=1)  # the activations go forward ...\n"
                        "        upstream = torch.empty_like(hidden)\n"
                        "        dist.recv(upstream, src=1)  # ... and their gradient comes back\n",
                        "        upstream = torch.empty_like(hidden)\n"
                        "        dist.recv(upstream, src=1)  # waits for rank 1, which waits for us\n"
                        "        dist.send(hidden.detach(), dst=1)\n")
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex1_test_two_stage")
    message = submissions.messages(report)["ex1_test_two_stage"]
    assert "deadlocked" in message and "ranks 0, 1" in message, message
    assert "rank 0 waits in recv" in message and "rank 1 waits in recv" in message, message
    assert "send and recv must pair up" in message and "rank 0 first SENDS" in message
    assert f"did not finish within {HANG_TIMEOUT} s" not in message  # the watch ended it, not the deadline
    assert seconds < HANG_TIMEOUT + 60, f"grading took {seconds:.0f} s"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_endless_loop_is_graded_within_the_check_timeout(tmp_path, monkeypatch):
    """average_gradients loops forever (all ranks in step): stopped at the check's deadline."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    nb = submissions.replace_answer(submissions.load(A), "ex1_average_gradients", '''
def average_gradients(model, n_local):
    params = list(model.parameters())
    i = 0
    while i < len(params):  # forgot i += 1
        dist.all_reduce(params[i].grad, op=dist.ReduceOp.SUM)
        params[i].grad /= n_local
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


# --- part 4: tensor parallelism --------------------------------------------------------------------------

import graders.parallelism.tensor_parallel as tp  # noqa: E402


class _CopyIn(torch.autograd.Function):
    """Identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _SumOut(torch.autograd.Function):
    """All-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _BothWays(torch.autograd.Function):
    """All-reduce forward AND backward (torch.distributed.nn.functional.all_reduce's semantics)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _mean_over_ranks(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


class _BothWaysDivided(_BothWays):
    """The same, with the backward's sum divided by the world size: right numbers, a needless all-reduce."""

    @staticmethod
    def backward(ctx, grad):
        return _mean_over_ranks(grad)


class _TPMLP(torch.nn.Module):
    """One module holding the four shards, in a tutorial's functional style."""

    def __init__(self, mlp, rank, world_size, copy_in=_CopyIn, sum_out=_SumOut, bias_before_sum=False,
                 keep_whole=False):
        super().__init__()
        first, self.act, second = mlp
        self.w1 = torch.nn.Parameter(first.weight.detach().chunk(world_size, dim=0)[rank].clone())
        self.b1 = torch.nn.Parameter(first.bias.detach().chunk(world_size)[rank].clone())
        self.w2 = torch.nn.Parameter(second.weight.detach().chunk(world_size, dim=1)[rank].clone())
        self.b2 = torch.nn.Parameter(second.bias.detach().clone())
        self.copy_in, self.sum_out, self.bias_before_sum = copy_in, sum_out, bias_before_sum
        if keep_whole:
            self.whole = second  # the whole layer kept as a submodule: its weight stays on every rank

    def forward(self, x):
        h = self.act(F.linear(self.copy_in.apply(x) if self.copy_in else x, self.w1, self.b1))
        if self.bias_before_sum:
            return self.sum_out.apply(F.linear(h, self.w2, self.b2))
        return self.sum_out.apply(F.linear(h, self.w2)) + self.b2


class _MeanOut(_SumOut):
    """Wrong: the partial outputs averaged, as data parallelism averages gradients."""

    @staticmethod
    def forward(ctx, x):
        return _mean_over_ranks(x)


class _MeanIn(torch.autograd.Function):
    """Wrong: identity forward, the input's partial gradients averaged in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _mean_over_ranks(grad)


class _BiasShares(torch.nn.Module):
    """Wrong: each rank adds a share of the second bias to its partial output before the sum (right output)."""

    def __init__(self, mlp, rank, world_size):
        super().__init__()
        self.inner = _TPMLP(mlp, rank, world_size)

    def forward(self, x):
        m = self.inner
        h = m.act(F.linear(m.copy_in.apply(x), m.w1, m.b1))
        return _SumOut.apply(F.linear(h, m.w2) + m.b2 / dist.get_world_size())


def tp_mean_out(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, sum_out=_MeanOut)


def tp_mean_in(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, copy_in=_MeanIn)


def tp_bias_shares(mlp, rank, world_size):
    return _BiasShares(mlp, rank, world_size)


def tp_functional(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size)


def tp_dtensor(mlp, rank, world_size):  # torch's own API: DTensor parameters, functional collectives
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    # each rank holds only its own shards (NaN elsewhere): keep them, instead of scattering rank 0's
    return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)


class _CopyInAsync(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient asynchronously and waits on the work handle."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True)
        work.wait()
        return grad


class _SumOutFuncol(torch.autograd.Function):
    """All-reduce forward with torch's functional collectives (a new tensor, waited on), identity backward."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_async_funcol(mlp, rank, world_size):
    """Right, other styles: an async all-reduce and its work handle in backward, a functional collective in
    forward (the result is a new tensor, not the argument summed in place)."""
    return _TPMLP(mlp, rank, world_size, copy_in=_CopyInAsync, sum_out=_SumOutFuncol)


class _BiasOnRankZero(_TPMLP):
    def forward(self, x):
        partial = F.linear(self.act(F.linear(self.copy_in.apply(x), self.w1, self.b1)), self.w2)
        return _SumOut.apply(partial + self.b2 if dist.get_rank() == 0 else partial)


def tp_bias_on_rank_zero(mlp, rank, world_size):  # right output, but rank 1's copy of the bias never learns
    return _BiasOnRankZero(mlp, rank, world_size)


def tp_bias_on_every_rank(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, bias_before_sum=True)


def tp_no_backward_all_reduce(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, copy_in=None)


def tp_all_reduce_both_ways(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, sum_out=_BothWays)


def tp_both_ways_divided(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, sum_out=_BothWaysDivided)


def tp_keeps_whole_layer(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, keep_whole=True)


def tp_wrong_dimension(mlp, rank, world_size):
    model = _TPMLP(mlp, rank, world_size)
    model.w2 = torch.nn.Parameter(mlp[2].weight.detach().chunk(world_size, dim=0)[rank].clone())  # rows, not columns
    return model


class _Gathered(torch.autograd.Function):
    """A forgery: the sum done with all_gather, plus a decoy all-reduce of zeros of the output's size."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        dist.all_reduce(torch.zeros_like(x))  # the decoy the flight recorder would count
        return sum(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_forged_sum(mlp, rank, world_size):
    return _TPMLP(mlp, rank, world_size, sum_out=_Gathered)


def tp_stub(mlp, rank, world_size):
    """As nbgrader releases it."""
    # YOUR CODE HERE
    raise NotImplementedError()


VALUES, COMM = tp.check_tensor_parallel, tp.check_tensor_parallel_collectives


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_right_answers_in_other_styles_pass_both_checks():
    for answer in (tp_functional, tp_dtensor, tp_async_funcol):
        for kwargs in ({}, {"world_sizes": (4,), "seed": 1, "dims": (3, 5, 8, 7)}):
            VALUES(answer, **kwargs)
            COMM(answer, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_mistakes_lose_exactly_their_checks():
    # values only: the same collectives, a wrong output
    fails(VALUES, tp_bias_on_every_rank, "bias was added on every rank", "2 times", "[ranks 0, 1]")
    COMM(tp_bias_on_every_rank)
    fails(VALUES, tp_keeps_whole_layer, "holds more than its shards", "(5, 12)")
    fails(VALUES, tp_bias_on_rank_zero, "second layer's bias, whole got no gradient on rank 1", "rank 0 only")
    COMM(tp_keeps_whole_layer)
    # collectives only: right numbers, an all-reduce too many
    VALUES(tp_both_ways_divided)
    fails(COMM, tp_both_ways_divided, "backward also all-reduced the output's gradient", "dividing")
    # both: the property each check judges is broken
    fails(VALUES, tp_no_backward_all_reduce, "only this rank's part", "all-reduce the gradient in backward")
    fails(COMM, tp_no_backward_all_reduce, "backward ran no all-reduce of the input gradient")
    fails(VALUES, tp_all_reduce_both_ways, "2 x the unsplit one")
    fails(COMM, tp_all_reduce_both_ways, "backward also all-reduced")
    fails(VALUES, tp_wrong_dimension, "wrong dimension", "(out_features, in_features)")
    fails(VALUES, tp_stub, "not written yet")
    fails(COMM, tp_stub, "not written yet")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_sums_made_means_are_named_as_such():
    """Averaging where tensor parallelism sums (data parallelism's habit) is named, not taken for a shape mistake or
    a thrown-away collective."""
    fails(VALUES, tp_mean_out, "partial outputs averaged, 1/2 of their sum", "SUM of the ranks' parts")
    fails(COMM, tp_mean_out, "what the forward's all-reduce returned divided by the world size", "1/2 of it")
    fails(VALUES, tp_mean_in, "input's gradient is 1/2 of the unsplit one", "SUM of the ranks' parts")
    fails(COMM, tp_mean_in, "what the backward's all-reduce returned divided by the world size")
    fails(VALUES, tp_bias_shares, "second layer's bias, whole differs", "1/2 of that gradient",
          "adds its whole copy once, after the sum")
    COMM(tp_bias_shares)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_forged_collectives_lose_the_collectives_check():
    VALUES(tp_forged_sum)  # the numbers are right ...
    fails(COMM, tp_forged_sum, "all_gather")  # ... but the sum was not an all-reduce of the partial outputs


class _Whole(torch.autograd.Function):
    """A forgery with no communication at all: every rank runs the whole MLP it was given (a copy outside the
    module's parameters) and writes its shards' gradients from the whole model's by hand."""

    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        ctx.save_for_backward(x)
        with torch.no_grad():
            return holder["whole"](x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        holder = ctx.holder
        whole, shards, rank, ws = holder["whole"], holder["shards"], holder["rank"], holder["ws"]
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            grads = torch.autograd.grad(whole(x), [x, *whole.parameters()], grad)
        g1, gb1, g2, gb2 = grads[1:]
        for p, g in zip(shards, (g1.chunk(ws)[rank], gb1.chunk(ws)[rank], g2.chunk(ws, dim=1)[rank], gb2)):
            p.grad = g.clone() if p.grad is None else p.grad + g
        return grads[0], None


class _ForgedLocal(torch.nn.Module):
    def __init__(self, mlp, rank, world_size):
        super().__init__()
        model = _TPMLP(mlp, rank, world_size)
        self.w1, self.b1, self.w2, self.b2 = model.w1, model.b1, model.w2, model.b2
        self.holder = {"whole": copy.deepcopy(mlp), "shards": [self.w1, self.b1, self.w2, self.b2], "rank": rank,
                       "ws": world_size}

    def forward(self, x):
        return _Whole.apply(x, self.holder)


def tp_forged_local(mlp, rank, world_size):
    return _ForgedLocal(mlp, rank, world_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_without_communication_loses_both_checks():
    """No rank split any work, and none can: each holds only its own shards (NaN elsewhere), so the whole MLP it
    keeps computes NaN; the collectives check says no all-reduce ran."""
    fails(VALUES, tp_forged_local, "holds NaN", "outside this rank's shard")
    fails(COMM, tp_forged_local, "the forward ran no all-reduce of the output", "never summed")
