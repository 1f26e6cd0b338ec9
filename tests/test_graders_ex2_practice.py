"""Exercise 2's second notebook (ddp_in_practice): each check catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with right and wrong functions directly: the reference, at least one right
answer in another style, realistic mistakes (each with the message that names it) and a forgery that
overwrites what the student's process can overwrite. Wrong submissions are the source notebook with
one answer edited, graded in this process; each must lose exactly the intended test cell's points.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.utils.data import DistributedSampler, Subset

import graders.ddp_in_practice.checks as ex2p
import graders.ddp_in_practice.hardest as hard
import graders.ddp_in_practice.precision as amp
from course.checks import TIMEOUT_ENV

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex2-ddp-basics"
NB = "ddp_in_practice"
HANG_TIMEOUT = 6  # the check timeout the unit tests of hangs use (DDP_COURSE_CHECK_TIMEOUT)

fails = submissions.fails


# --- part 1: the k hardest samples ------------------------------------------------------------------


def hardest(model, dataset, rank, world_size, sample_losses, k):
    mine = list(range(rank, len(dataset), world_size))
    losses = sample_losses(model, Subset(dataset, mine))
    best = losses.topk(min(k, len(mine)))
    candidates = [(loss, mine[i]) for loss, i in zip(best.values.tolist(), best.indices.tolist())]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, candidates)
    ranked = sorted((c for cs in everyone for c in cs), reverse=True)
    return [i for _, i in ranked[:k]]


def hardest_padded_tensors(model, dataset, rank, world_size, sample_losses, k):
    """Right, another style: chunks of the dataset, each rank's k candidates as (loss, index) rows of one float
    tensor padded with -inf to k rows, all-gathered as tensors; the answer the index column, a float tensor."""
    start, stop = (torch.tensor_split(torch.arange(len(dataset)), world_size)[rank][[0, -1]] + torch.tensor([0, 1])).tolist()
    losses = sample_losses(model, Subset(dataset, range(start, stop)))
    rows = torch.full((k, 2), float("-inf"), device=losses.device)
    got = losses.topk(min(k, len(losses)))
    rows[:len(got.values), 0], rows[:len(got.values), 1] = got.values, (got.indices + start).float()
    everyone = [torch.empty_like(rows) for _ in range(world_size)]
    dist.all_gather(everyone, rows)
    table = torch.cat(everyone)
    return table[table[:, 0].argsort(descending=True)[:k], 1]


class HardestOnRankZero:
    """Right, another style: every rank sends all its (loss, index) pairs to rank 0, which ranks them and
    broadcasts the answer (numpy on the way)."""

    def __init__(self, world_size, rank):
        self.world_size, self.rank = world_size, rank

    def share(self, n):
        return [i for i in range(n) if i % self.world_size == self.rank]

    def __call__(self, model, dataset, sample_losses, k):
        import numpy as np

        mine = self.share(len(dataset))
        pairs = list(zip(sample_losses(model, Subset(dataset, mine)).cpu().numpy().tolist(), mine))
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(pairs, gathered, dst=0)
        answer = [None]
        if self.rank == 0:
            pairs = [p for part in gathered for p in part]
            losses = np.array([p[0] for p in pairs])
            answer = [[pairs[j][1] for j in np.argsort(-losses)[:k]]]
        dist.broadcast_object_list(answer, src=0)
        return np.array(answer[0])


def hardest_on_rank_zero(model, dataset, rank, world_size, sample_losses, k):
    return HardestOnRankZero(world_size, rank)(model, dataset, sample_losses, k)


def hardest_local(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: each rank's own hardest (no communication)."""
    mine = list(range(rank, len(dataset), world_size))
    best = sample_losses(model, Subset(dataset, mine)).topk(min(k, len(mine)))
    return [mine[i] for i in best.indices.tolist()]


def hardest_positions(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: the candidates carry their positions in the share, not their dataset indices."""
    mine = list(range(rank, len(dataset), world_size))
    best = sample_losses(model, Subset(dataset, mine)).topk(min(k, len(mine)))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, list(zip(best.values.tolist(), best.indices.tolist())))
    return [i for _, i in sorted((c for cs in everyone for c in cs), reverse=True)[:k]]


def hardest_easiest_first(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: the right samples, the lowest loss first."""
    return hardest(model, dataset, rank, world_size, sample_losses, k)[::-1]


def hardest_padded_sampler(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: the training sampler's split, which repeats samples to pad (its answer drops repeats)."""
    mine = list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False))
    losses = sample_losses(model, Subset(dataset, mine)).tolist()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, dict(zip(mine, losses)))
    merged = {i: loss for part in everyone for i, loss in part.items()}
    return sorted(merged, key=lambda i: -merged[i])[:k]


def hardest_whole(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: every rank evaluates the whole dataset."""
    return sample_losses(model, dataset).topk(k).indices.tolist()


def hardest_topk_of_k(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: asks every rank for k candidates of its own, which a rank with fewer than k samples has not."""
    mine = list(range(rank, len(dataset), world_size))
    best = sample_losses(model, Subset(dataset, mine)).topk(k)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(v, mine[i]) for v, i in zip(best.values.tolist(), best.indices.tolist())])
    return [i for _, i in sorted((c for cs in everyone for c in cs), reverse=True)[:k]]


def hardest_not_reranked(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: every rank's candidates gathered, then the first k of them taken in rank order, not by loss."""
    mine = list(range(rank, len(dataset), world_size))
    best = sample_losses(model, Subset(dataset, mine)).topk(min(k, len(mine)))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [mine[i] for i in best.indices.tolist()])
    return [i for part in everyone for i in part][:k]


def hardest_too_few_candidates(model, dataset, rank, world_size, sample_losses, k):
    """Wrong: k // world_size candidates from each rank, fewer than k in all."""
    mine = list(range(rank, len(dataset), world_size))
    best = sample_losses(model, Subset(dataset, mine)).topk(k // world_size)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(v, mine[i]) for v, i in zip(best.values.tolist(), best.indices.tolist())])
    return [i for _, i in sorted((c for cs in everyone for c in cs), reverse=True)[:k]]


def hardest_share_evaluated_twice(model, dataset, rank, world_size, sample_losses, k):
    """Right: its share through the model twice (once more to log a mean), each sample still on one rank."""
    mine = list(range(rank, len(dataset), world_size))
    print(f"rank {rank}: mean loss {sample_losses(model, Subset(dataset, mine)).mean().item():.3f}")
    return hardest(model, dataset, rank, world_size, sample_losses, k)


def hardest_around_the_model(model, dataset, rank, world_size, sample_losses, k):
    """Wrong, and hides it: its share goes through model(x), as the grader records; then it ranks the whole
    dataset on every rank through the model's layer (no communication)."""
    device = next(model.parameters()).device
    sample_losses(model, Subset(dataset, range(rank, len(dataset), world_size)))
    x, y = dataset.tensors
    with torch.no_grad():
        losses = F.cross_entropy(model.linear(x.to(device)), y.to(device), reduction="none")
    return losses.topk(k).indices.tolist()


def hardest_split_by_labels(model, dataset, rank, world_size, sample_losses, k):
    """Wrong, and opts out of the second run: a split drawn from the labels, the whole dataset ranked through the
    model's layer."""
    x, y = dataset.tensors
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(int(y.sum()))).tolist()
    sample_losses(model, Subset(dataset, order[rank::world_size]))
    with torch.no_grad():
        losses = F.cross_entropy(model.linear(x), y, reduction="none")
    return losses.topk(k).indices.tolist()


def _kept(x, world_size, rank) -> str:
    import os
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"hardest-{float(x.sum()):.6f}-{world_size}-{rank}")


def hardest_remembered(model, dataset, rank, world_size, sample_losses, k):
    """Wrong, and replays: the right answer on the first call, kept in a file; every later call on the same inputs
    returns the kept list."""
    import json
    import os

    kept = _kept(dataset.tensors[0], world_size, rank)
    if os.path.exists(kept):
        sample_losses(model, Subset(dataset, range(rank, len(dataset), world_size)))
        with open(kept) as file:
            return json.load(file)
    value = hardest(model, dataset, rank, world_size, sample_losses, k)
    with open(kept, "w") as file:
        json.dump(value, file)
    return value


def hardest_forged(model, dataset, rank, world_size, sample_losses, k):
    """Communicates with no one: makes torch.distributed say this is a 1-rank job, so that its split hands this rank
    everything and the gather is its own list."""
    from torch.distributed import distributed_c10d as c10d

    for module in (dist, c10d):
        module.get_world_size = lambda group=None: 1
        module.get_rank = lambda group=None: 0
        module.all_gather_object = lambda out, obj, group=None: out.__setitem__(0, obj)
    return hardest(model, dataset, dist.get_rank(), dist.get_world_size(), sample_losses, k)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_hardest_accepts_right_answers_in_several_styles():
    for right in (hardest, hardest_padded_tensors, hardest_on_rank_zero, hardest_share_evaluated_twice):
        hard.check_hardest(right)
        hard.check_hardest(right, world_size=4, n=14, k=5, batch_size=3, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_hardest_names_each_mistake():
    fails(hard.check_hardest, hardest_local, "[ranks 0, 1, 2]", "did not return the 4 hardest samples of the whole "
          "dataset", "its own share only", "rank 2: [")
    fails(hard.check_hardest, hardest_positions, "positions within a rank's share, not indices of the dataset")
    fails(hard.check_hardest, hardest_easiest_first, "ordered from the easiest")
    fails(hard.check_hardest, hardest_padded_sampler, "went through the model on more than one rank",
          "sample 0 on ranks 0, 2", "a split that pads")
    fails(hard.check_hardest, hardest_whole, "[ranks 0, 1, 2]", "evaluated more than one rank's share",
          "at most 4 samples per rank", "[11, 11, 11]", "every rank evaluated the whole dataset")
    fails(hard.check_hardest, hardest_topk_of_k, "selected index k out of range",
          "may hold fewer than k samples")
    fails(hard.check_hardest, hardest_forged, "evaluated more than one rank's share", "[11, 11, 11]")
    fails(hard.check_hardest, hardest_not_reranked, "the other ranks' candidates arrived", "rank every candidate")
    fails(hard.check_hardest, hardest_too_few_candidates, "the list holds 3 indices, not k = 4")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_hardest_cannot_be_opted_out_of_its_second_run():
    """The second run changes only labels, each rank its own share's: a split that follows them is itself the
    evidence, a list kept from the first run is not the second run's, and a rank that ranks the other ranks'
    samples itself ranks them by its copy's labels, which are not theirs."""
    fails(hard.check_hardest, hardest_split_by_labels, "the samples each rank evaluated changed when only the labels "
          "changed", "evaluated samples [", "], then [", "split the samples by their index")
    # (which ranks the message names varies: a rank's own ranking of the others' samples is right in a call by chance)
    fails(hard.check_hardest, hardest_around_the_model, "ranked samples", "model did not evaluate",
          "each rank's share labelled by that rank alone", "from the other ranks (a collective)")
    x = hard._inputs(11, 0)
    kept = [_kept(x, 3, rank) for rank in range(3)]
    for path in kept:  # a file left by an earlier session would be "remembered" in the first run too
        if os.path.exists(path):
            os.remove(path)
    try:
        fails(hard.check_hardest, hardest_remembered, "returned the first run's list again", "do not return one kept "
              "from an earlier call")
    finally:
        for path in kept:
            if os.path.exists(path):
                os.remove(path)


def test_the_first_runs_data_tells_the_mistakes_apart():
    """For the visible and the hidden sizes: the answer's losses stand apart, the answer is no rank's own hardest in
    any usual split, and holds samples of two ranks at least; a valid list is judged by its losses."""
    for n, world_size, k, seed in ((11, 3, 4, 0), (14, 4, 5, 1)):
        losses = hard.losses_of(n, seed, hard.hard_case(n, world_size, k, seed))
        want = hard.top(losses, k)
        assert hard.valid(want, losses, k)
        assert not hard.valid(want[::-1], losses, k) and not hard.valid(want[:-1], losses, k)
        assert not hard.valid(want[:-1] + [want[0]], losses, k)
        for split in hard._splits(n, world_size).values():
            assert len({r for r, s in enumerate(split) for i in s if i in want}) >= 2
    swapped = [1.0, 1.0 + hard.TOLERANCE / 2, 0.5]  # equal to rounding: either order is right
    assert hard.valid([0, 1], swapped, 2) and hard.valid([1, 0], swapped, 2)


def test_private_labels_are_drawn_per_rank_and_label_the_rest_with_their_worst_class():
    draws = hard._private_labels(11, 0, [0, 3, 6, 9], 4)
    worst = hard._worst(11, 0)
    for mine, labels in draws:
        assert [i for i, _ in mine] == [0, 3, 6, 9]
        assert all(labels[i] == worst[i] for i in range(11) if i not in (0, 3, 6, 9))
        assert all(labels[i] == c for i, c in mine)
    assert len({d[0] for d in draws}) > 1  # new labels every call


# --- part 2: accumulate_grads (the given code steps after it) -------------------------------------


def accumulate_grads(ddp_model, micro_batches):
    k = len(micro_batches)
    total = sum(len(x) for x, _ in micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if i < k - 1:
            with ddp_model.no_sync():
                (F.mse_loss(ddp_model(x), y) * len(x) / total).backward()
        else:
            (F.mse_loss(ddp_model(x), y) * len(x) / total).backward()


def accumulate_docs_style(ddp_model, micro_batches):
    """Right, the idiom of DDP's no_sync() documentation: one `with` around the first k-1 micro-batches;
    summed losses, and the gradients divided once by the number of values after the backward passes."""
    *first, last = micro_batches
    with ddp_model.no_sync():
        for x, y in first:
            F.mse_loss(ddp_model(x), y, reduction="sum").backward()  # no synchronization, accumulate grads
    F.mse_loss(ddp_model(last[0]), last[1], reduction="sum").backward()  # synchronize grads
    values = sum(y.numel() for _, y in micro_batches)
    for p in ddp_model.parameters():
        p.grad /= values


def accumulate_nullcontext(ddp_model, micro_batches):
    """Right, another spelling: a context chosen per micro-batch, the loss weighted by the batch's fraction."""
    k = len(micro_batches)
    fractions = torch.tensor([float(len(x)) for x, _ in micro_batches])
    fractions /= fractions.sum()
    for i, (x, y) in enumerate(micro_batches):
        context = ddp_model.no_sync() if i + 1 < k else contextlib.nullcontext()
        with context:
            loss = F.mse_loss(ddp_model(x), y) * fractions[i]
            loss.backward()


def _accumulate(ddp_model, micro_batches, *, no_sync=True, divide="share", zero_each=False, sync_at=None):
    k = len(micro_batches)
    total = sum(len(x) for x, _ in micro_batches)
    sync_at = k - 1 if sync_at is None else sync_at
    for i, (x, y) in enumerate(micro_batches):
        if zero_each:
            ddp_model.zero_grad()
        context = ddp_model.no_sync() if no_sync and i != sync_at else contextlib.nullcontext()
        with context:
            loss = F.mse_loss(ddp_model(x), y)
            (loss * len(x) / total if divide == "share" else loss / k if divide == "count" else loss).backward()


def accumulate_without_no_sync(ddp_model, micro_batches):
    _accumulate(ddp_model, micro_batches, no_sync=False)


def accumulate_not_divided(ddp_model, micro_batches):
    _accumulate(ddp_model, micro_batches, divide="none")


def accumulate_divided_by_count(ddp_model, micro_batches):
    """The lesson's rule (loss / k) applied to micro-batches of unequal sizes."""
    _accumulate(ddp_model, micro_batches, divide="count")


def accumulate_zero_each(ddp_model, micro_batches):
    """Mistake: a plain loop's habit, the gradients zeroed before every micro-batch: only the last one's reaches
    the step."""
    _accumulate(ddp_model, micro_batches, zero_each=True)


def accumulate_sync_first(ddp_model, micro_batches):
    _accumulate(ddp_model, micro_batches, sync_at=0)


def accumulate_never_sync(ddp_model, micro_batches):
    _accumulate(ddp_model, micro_batches, sync_at=-1)


def accumulate_synced_by_hand(ddp_model, micro_batches):
    """Right weights, but every backward inside no_sync() and the gradients all-reduced by hand, one
    parameter at a time, instead of DDP's one bucketed all-reduce."""
    total = sum(len(x) for x, _ in micro_batches)
    with ddp_model.no_sync():
        for x, y in micro_batches:
            (F.mse_loss(ddp_model(x), y) * len(x) / total).backward()
    for p in ddp_model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def accumulate_forged(ddp_model, micro_batches):
    """Syncs every micro-batch, then makes the grader's communication hook say once, in the last backward:
    it rewrites the hook's state and the lists its closure counts in, drops DDP's record of the hook and
    replaces torch's all_reduce."""
    k = len(micro_batches)
    _accumulate(ddp_model, micro_batches, no_sync=False)
    for hook, state in ddp_model._comm_hooks:
        if isinstance(state, dict):
            state.update({key: 1 for key in state})
        for cell in getattr(hook, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, list) and len(value) == k and all(isinstance(v, int) for v in value):
                value[:] = [k]  # "one sync, after the k-th forward"
    ddp_model._comm_hooks.clear()
    dist.all_reduce = lambda *args, **kwargs: None


def accumulate_forged_by_hand(ddp_model, micro_batches):
    """Forgery (issue 24, class 1): DDP never syncs (every backward inside no_sync()), the gradients travel in
    all_gathers by hand, and the grader's hook record is made to say "once, after the last forward"."""
    k = len(micro_batches)
    total = sum(len(x) for x, _ in micro_batches)
    with ddp_model.no_sync():
        for x, y in micro_batches:
            (F.mse_loss(ddp_model(x), y) * len(x) / total).backward()
    world_size = dist.get_world_size()
    for p in ddp_model.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(parts, p.grad)
        p.grad.copy_(torch.stack(parts).mean(0))
    for hook, _ in ddp_model._comm_hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            if isinstance(cell.cell_contents, list) and not cell.cell_contents:
                cell.cell_contents.append(k)  # the hook's list of syncs: one, after the k-th forward


def accumulate_sync_first_forged(ddp_model, micro_batches):
    """Forgery: syncs in the first micro-batch's backward, then makes the hook's record say the last."""
    _accumulate(ddp_model, micro_batches, sync_at=0)
    for hook, _ in ddp_model._comm_hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            if cell.cell_contents == [1]:
                cell.cell_contents[:] = [len(micro_batches)]


def accumulate_gathers_too(ddp_model, micro_batches):
    """Mistake: DDP's one sync in the last backward, right weights, but after every backward the gradients are
    also all-gathered by hand (to look at them): k more rounds of communication."""
    k = len(micro_batches)
    total = sum(len(x) for x, _ in micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.mse_loss(ddp_model(x), y) * len(x) / total).backward()
        for p in ddp_model.parameters():
            dist.all_gather([torch.empty_like(p.grad) for _ in range(dist.get_world_size())], p.grad)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_accumulation():
    ex2p.check_accumulation(accumulate_grads)
    ex2p.check_accumulation(accumulate_grads, world_size=3, k=3, seed=1)
    ex2p.check_accumulation(accumulate_docs_style)
    ex2p.check_accumulation(accumulate_nullcontext, world_size=3, k=3, seed=1)
    ex2p.check_accumulation(accumulate_without_no_sync)  # the communication is check_no_sync's business
    ex2p.check_accumulation(accumulate_synced_by_hand)
    fails(ex2p.check_accumulation, accumulate_not_divided, "differ from one process's step", "the sum of the "
          "micro-batches' mean gradients", "share of this rank's samples")
    fails(ex2p.check_accumulation, accumulate_divided_by_count, "differ from one process's step",
          "each micro-batch counted as much as the others", "equally large")
    fails(ex2p.check_accumulation, accumulate_zero_each, "differ from one process's step",
          "only the last micro-batch's gradient", "no zero_grad() inside accumulate_grads")
    fails(ex2p.check_accumulation, accumulate_sync_first, "different weights", "outside no_sync()")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_no_sync():
    ex2p.check_no_sync(accumulate_grads)
    ex2p.check_no_sync(accumulate_grads, world_size=3, k=3, seed=1)
    ex2p.check_no_sync(accumulate_docs_style)
    ex2p.check_no_sync(accumulate_nullcontext)
    ex2p.check_no_sync(accumulate_not_divided)  # the weights are check_accumulation's business
    message = fails(ex2p.check_no_sync, accumulate_without_no_sync, "[rank 0]", "4 times in one accumulate_grads",
                    "expected: 1 all-reduce per call", "forwards [1, 2, 3, 4] of 4", "the DDP model's no_sync() context")
    assert "the weights are right" in message
    fails(ex2p.check_no_sync, accumulate_sync_first, "before the last micro-batch", "forwards [1] of 4")
    fails(ex2p.check_no_sync, accumulate_never_sync, "never all-reduced", "outside no_sync()")
    fails(ex2p.check_no_sync, accumulate_synced_by_hand, "never all-reduced", "syncing by hand")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_no_sync_counts_what_the_student_cannot_reach():
    message = fails(ex2p.check_no_sync, accumulate_forged, "4 times in one accumulate_grads")
    assert "the weights are right" in message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_no_sync_judges_what_the_collectives_carried():
    """Issue 24, class 1: the count is the process group's, whatever the hook's record says; the one all-reduce
    must carry all k micro-batches; gradients sent by another collective are seen."""
    ex2p.check_accumulation(accumulate_forged_by_hand)
    fails(ex2p.check_no_sync, accumulate_forged_by_hand, "never all-reduced", "no gradient all-reduce")
    fails(ex2p.check_no_sync, accumulate_sync_first_forged, "did not carry the gradients of all 4 micro-batches",
          "micro-batches 1 to 1 only", "sync in the last micro-batch")
    ex2p.check_accumulation(accumulate_gathers_too)
    message = fails(ex2p.check_no_sync, accumulate_gathers_too, "also sent by other collectives", "all_gather",
                    "no all_reduce or all_gather of the gradients by hand")
    assert "the weights are right" in message
    fails(ex2p.check_no_sync, accumulate_gathers_too, "also sent by other collectives", world_size=3, k=3, seed=1)


# --- part 3: train_uneven --------------------------------------------------------------------------


def train_uneven(ddp_model, optimizer, batches, train_steps):
    with ddp_model.join(divide_by_initial_world_size=False):
        train_steps(ddp_model, optimizer, batches)


def train_uneven_join_default(ddp_model, optimizer, batches, train_steps):
    """Mistake: lesson 2's Join as it comes: the finished ranks' zeros count in the mean."""
    with ddp_model.join():
        train_steps(ddp_model, optimizer, batches)


def train_uneven_join_active(ddp_model, optimizer, batches, train_steps):
    """Right, the general context manager, averaging over the ranks still training."""
    with Join([ddp_model], divide_by_initial_world_size=False):
        train_steps(ddp_model, optimizer, batches)


def train_uneven_fewest(ddp_model, optimizer, batches, train_steps):
    """Right, another way: agree on the number of steps first."""
    device = next(ddp_model.parameters()).device
    steps = torch.tensor([len(batches)], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    train_steps(ddp_model, optimizer, batches[: int(steps.item())])


def train_uneven_dummy_steps(ddp_model, optimizer, batches, train_steps):
    """Right, by hand, its own loop instead of the given one: as many steps as the rank with the most batches; a
    rank without a batch contributes a zero gradient, and the loss is scaled so that DDP's mean is over the ranks
    that trained in the step."""
    world_size = dist.get_world_size()
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    for i in range(int(steps)):
        active = torch.tensor([1.0 if i < len(batches) else 0.0])
        dist.all_reduce(active)  # how many ranks train in this step
        optimizer.zero_grad()
        x, y = batches[min(i, len(batches) - 1)]
        loss = F.mse_loss(ddp_model(x), y)
        (loss * (world_size / active.item()) if i < len(batches) else 0.0 * loss).backward()
        optimizer.step()


def train_uneven_plain(ddp_model, optimizer, batches, train_steps):
    train_steps(ddp_model, optimizer, batches)


def train_uneven_summed_count(ddp_model, optimizer, batches, train_steps):
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps)  # SUM, not MIN
    train_steps(ddp_model, optimizer, batches[: int(steps) // dist.get_world_size()])


def train_uneven_join_each_step(ddp_model, optimizer, batches, train_steps):
    for batch in batches:
        with ddp_model.join():
            train_steps(ddp_model, optimizer, [batch])


def train_uneven_breaks_when_out(ddp_model, optimizer, batches, train_steps):
    """Agrees on the most batches, but a rank with none left breaks out of the loop (on that rank only)."""
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    for i in range(int(steps)):
        if i >= len(batches):
            break
        train_steps(ddp_model, optimizer, [batches[i]])


def train_uneven_recycled(ddp_model, optimizer, batches, train_steps):
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    train_steps(ddp_model, optimizer, [batches[i % len(batches)] for i in range(int(steps))])


def train_uneven_forged(ddp_model, optimizer, batches, train_steps):
    """Never waits: trains without DDP's all-reduce, then fakes agreement by giving every rank rank 0's weights."""
    with ddp_model.no_sync():
        train_steps(ddp_model, optimizer, batches)
    for p in ddp_model.parameters():
        dist.broadcast(p.data, src=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_uneven_accepts_join_and_an_equalised_loop():
    ex2p.check_uneven(train_uneven)
    ex2p.check_uneven(train_uneven, counts=(4, 2, 5), seed=1)
    fails(ex2p.check_uneven, train_uneven_join_default, "averaged over the full world size (Join's default)",
          "divide_by_initial_world_size", counts=(4, 2, 5), seed=1)
    ex2p.check_uneven(train_uneven_join_active, counts=(4, 2, 5), seed=1)
    ex2p.check_uneven(train_uneven_fewest)
    ex2p.check_uneven(train_uneven_fewest, counts=(4, 2, 5), seed=1)
    ex2p.check_uneven(train_uneven_dummy_steps, counts=(4, 2, 5), seed=1)


def test_uneven_references_differ():
    """Join, Join over the active ranks, the equalised loop and recycling batches give different weights."""
    states = [ex2p._uneven_reference([4, 2, 5], 2, 0.1, 1, mode) for mode in ("join", "join-active", "fewest",
                                                                               "recycled")]
    for i, a in enumerate(states):
        for b in states[i + 1:]:
            assert ex2p._diff(a, b) > 1e-4


def train_uneven_rank0_count(ddp_model, optimizer, batches, train_steps):
    """Wrong: every rank trains as many batches as rank 0 has (broadcast), not as many as the rank with the fewest."""
    n = torch.tensor([len(batches)])
    dist.broadcast(n, src=0)
    train_steps(ddp_model, optimizer, batches[:int(n)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_uneven_names_the_rank_that_ran_out_when_the_job_hangs(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    fails(ex2p.check_uneven, train_uneven_plain, "did not return on every rank",
          "rank 1 ran out of batches first, after 3 batches (rank 0 has 5)", "ddp_model.join()", "ReduceOp.MIN")
    fails(ex2p.check_uneven, train_uneven_summed_count, "rank 1 ran out of batches first, after 2 batches",
          counts=(4, 2, 5), seed=1)
    fails(ex2p.check_uneven, train_uneven_join_each_step, "rank 1 ran out of batches first")
    fails(ex2p.check_uneven, train_uneven_breaks_when_out, "rank 1 ran out of batches first")
    # rank 0's count taken for everyone's: the visible job gives rank 0 the most batches, so it hangs there too
    fails(ex2p.check_uneven, train_uneven_rank0_count, "rank 1 ran out of batches first")
    assert time.monotonic() - start < 5 * HANG_TIMEOUT + 30


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_uneven_rejects_other_weights():
    fails(ex2p.check_uneven, train_uneven_recycled, "[ranks 0, 1]", "neither those of", "trained on their first "
          "batches again")
    fails(ex2p.check_uneven, train_uneven_forged, "neither those of", counts=(4, 2, 5), seed=1)


# --- part 4: load_checkpoint -----------------------------------------------------------------------


def load_checkpoint(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_on_cpu_into_the_wrapper(ckpt_path, ddp_model, device):
    """Right, another style: onto the CPU, the keys given DDP's prefix, loaded through the wrapper; the
    epoch as a tensor."""
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    ddp_model.load_state_dict({f"module.{k}": v for k, v in checkpoint["model"].items()})
    return torch.tensor(checkpoint["epoch"])


def load_with_a_function(ckpt_path, ddp_model, device):
    """Right, older tutorials' idiom: a map_location function that keeps each storage where it was read (the CPU)."""
    checkpoint = torch.load(ckpt_path, map_location=lambda storage, location: storage)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return int(checkpoint["epoch"])


def load_with_a_dict(ckpt_path, ddp_model, device):
    """Right, the DDP tutorial's idiom with this rank's device: a dict from the saved location to the new one."""
    checkpoint = torch.load(ckpt_path, map_location={"cuda:0": str(device)})
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_without_map_location(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_into_the_wrapper(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    ddp_model.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_not_strict(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    ddp_model.load_state_dict(checkpoint["model"], strict=False)  # "fixes" the missing keys: loads nothing
    return checkpoint["epoch"]


def load_no_epoch(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    ddp_model.module.load_state_dict(checkpoint["model"])


def load_whole_checkpoint(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    ddp_model.module.load_state_dict(checkpoint)
    return checkpoint["epoch"]


def load_assigned(ckpt_path, ddp_model, device):
    checkpoint = torch.load(ckpt_path, map_location="meta")
    ddp_model.module.load_state_dict(checkpoint["model"], assign=True)
    return checkpoint["epoch"]


_torch_load = torch.load  # bound at module level, before any check runs: the restore spy still sees it


def load_bound_early(ckpt_path, ddp_model, device):
    """Right, another style: torch.load bound at module level, used with map_location."""
    checkpoint = _torch_load(ckpt_path, map_location=device)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_bound_early_without_map_location(ckpt_path, ddp_model, device):
    checkpoint = _torch_load(ckpt_path)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_where_cuda0_exists_bound_early(ckpt_path, ddp_model, device):
    """load_where_cuda0_exists with torch.load and the serialization module's load bound before the job."""
    torch.serialization.register_package(5, lambda storage: None,
                                         lambda storage, location: storage if location == "cuda:0" else None)
    checkpoint = _torch_load(ckpt_path)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_forged(ckpt_path, ddp_model, device):
    """Loads without map_location after making torch say there is a GPU (and removing the grader's
    serialization entries)."""
    torch.serialization._package_registry[:] = [p for p in torch.serialization._package_registry if p[0] >= 0]
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    checkpoint = torch.load(ckpt_path)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


def load_unwatched_where_cuda0_exists(ckpt_path, ddp_model, device):
    """load_where_cuda0_exists after removing the grader's restore spy from torch's registry: the tensors go to
    "cuda:0" unseen by the spy, but the edited registry is seen."""
    torch.serialization._package_registry[:] = [p for p in torch.serialization._package_registry if p[0] >= 0]
    return load_where_cuda0_exists(ckpt_path, ddp_model, device)


def load_where_cuda0_exists(ckpt_path, ddp_model, device):
    """No map_location, on a machine where cuda:0 exists: stands in for one by a deserializer that takes
    storages tagged cuda:0 (as torch's own does where there is a GPU), after the grader's restore spy."""
    torch.serialization.register_package(5, lambda storage: None,
                                         lambda storage, location: storage if location == "cuda:0" else None)
    checkpoint = torch.load(ckpt_path)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what happens on a machine without CUDA")
def test_the_checkpoint_needs_map_location_without_a_gpu(tmp_path):
    path = tmp_path / "ckpt.pt"
    ex2p.save_from_gpu({"epoch": 3, "model": {"w": torch.ones(2)}}, path)
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
        torch.load(path)
    for where in ("cpu", torch.device("cpu")):
        assert torch.equal(torch.load(path, map_location=where)["model"]["w"], torch.ones(2))
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)  # the tag was for that one save only
    assert torch.load(io.BytesIO(buffer.getvalue()))["w"].device.type == "cpu"


def load_onto_cuda(ckpt_path, ddp_model, device):
    """Right on a GPU machine only (after set_device, "cuda" is the rank's GPU): a CPU has none to map to."""
    checkpoint = torch.load(ckpt_path, map_location="cuda")
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_load_checkpoint():
    ex2p.check_load_checkpoint(load_checkpoint)
    ex2p.check_load_checkpoint(load_checkpoint, world_size=3, seed=1)
    ex2p.check_load_checkpoint(load_on_cpu_into_the_wrapper)
    ex2p.check_load_checkpoint(load_with_a_function, world_size=3, seed=1)
    ex2p.check_load_checkpoint(load_with_a_dict)
    fails(ex2p.check_load_checkpoint, load_without_map_location, "[ranks 0, 1]", "on cuda:0, where rank 0 saved them",
          "expected: on each rank's device (rank 0: cpu) or on the CPU", "map_location=device")
    fails(ex2p.check_load_checkpoint, load_onto_cuda, "[ranks 0, 1]", "torch.load failed on ranks 0, 1",
          "map_location=device), with the device the function is given", "a fixed 'cuda' fails where there is no GPU")
    fails(ex2p.check_load_checkpoint, load_into_the_wrapper, "Missing key(s)", "ddp_model.module.load_state_dict")
    fails(ex2p.check_load_checkpoint, load_not_strict, "does not hold the saved weights", "strict=False")
    fails(ex2p.check_load_checkpoint, load_no_epoch, "did not return the saved epoch", "expected: 5",
          "got:      <NoneType>", "return checkpoint['epoch']")
    fails(ex2p.check_load_checkpoint, load_whole_checkpoint, "Unexpected key(s)", "load checkpoint['model']")
    fails(ex2p.check_load_checkpoint, load_assigned, "not on the rank's device", "['meta']", "assign=True")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_load_checkpoint_sees_where_torch_restored_the_tensors():
    fails(ex2p.check_load_checkpoint, load_where_cuda0_exists, "[ranks 0, 1]", "restored them on cuda:0")
    fails(ex2p.check_load_checkpoint, load_forged, "raised")
    fails(ex2p.check_load_checkpoint, load_unwatched_where_cuda0_exists, "[ranks 0, 1]", "changed torch's restore step",
          "leave torch's serialization alone")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_load_checkpoint_sees_loaders_bound_before_the_job():
    ex2p.check_load_checkpoint(load_bound_early)
    fails(ex2p.check_load_checkpoint, load_bound_early_without_map_location, "[ranks 0, 1]",
          "on cuda:0, where rank 0 saved them", "map_location=device")
    fails(ex2p.check_load_checkpoint, load_where_cuda0_exists_bound_early, "[ranks 0, 1]", "restored them on cuda:0")


# --- part 5: amp_clip_grads (the given code steps after it) ----------------------------------------


def _amp_loss(ddp_model, x, y, k, dtype=torch.float16):
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        return F.mse_loss(ddp_model(x), y) / k


def amp_clip_grads(ddp_model, optimizer, scaler, micro_batches, max_norm):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else ddp_model.no_sync():
            scaler.scale(_amp_loss(ddp_model, x, y, k)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_recipe_style(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Right, PyTorch's AMP recipe: torch.amp.autocast with enabled=, one `with no_sync()` around the first k - 1
    micro-batches, clip_grad_norm_ with foreach."""
    *first, last = micro_batches
    k = len(micro_batches)
    with ddp_model.no_sync():
        for x, y in first:
            with torch.amp.autocast(x.device.type, dtype=torch.float16, enabled=True):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss / k).backward()
    with torch.amp.autocast(last[0].device.type, dtype=torch.float16, enabled=True):
        loss = F.mse_loss(ddp_model(last[0]), last[1])
    scaler.scale(loss / k).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm=max_norm, foreach=True)


class ScaledClipper:
    """Right, a helper class: the loss scaled by hand (scaler.get_scale()), a hand-made global norm of the true
    gradients (the scaled ones divided by the scale), and the scaled gradients multiplied by its clip factor:
    the given scaler.step unscales them."""

    def __init__(self, ddp_model, scaler, max_norm):
        self.model, self.scaler, self.max_norm = ddp_model, scaler, max_norm

    def clip(self):
        scale = self.scaler.get_scale()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g / scale) for g in grads]))
        factor = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor)


def amp_helper_class(ddp_model, optimizer, scaler, micro_batches, max_norm):
    k = len(micro_batches)
    clipper = ScaledClipper(ddp_model, scaler, max_norm)
    for i, (x, y) in enumerate(micro_batches):
        context = ddp_model.no_sync() if i + 1 < k else contextlib.nullcontext()
        with context:
            (_amp_loss(ddp_model, x, y, k) * scaler.get_scale()).backward()
    clipper.clip()


def amp_one_backward(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Right, another way: every forward first (the first k - 1 under no_sync()), one scaled backward of the mean."""
    k = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                losses.append(F.mse_loss(ddp_model(x), y))
    scaler.scale(torch.stack(losses).mean()).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_backward_inside_autocast(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Right, a common spelling: the scaled backward inside the autocast block too (its ops follow the forward's
    dtypes)."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                scaler.scale(F.mse_loss(ddp_model(x), y) / k).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def _amp(ddp_model, optimizer, scaler, micro_batches, max_norm, *, dtype=torch.float16, scaled=True, no_sync=True,
         unscale=True, clip="after", step=None, weight=1.0, unscale_at=None, then=None):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext():
            loss = _amp_loss(ddp_model, x, y, k, dtype) * weight
            (scaler.scale(loss) if scaled is True else loss * scaled if scaled else loss).backward()
            if clip == "each" or (clip == "inside" and i == k - 2):
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)
        if unscale_at == i:
            scaler.unscale_(optimizer)
    if clip == "after":
        if unscale == "by hand":
            for p in ddp_model.parameters():
                p.grad.div_(scaler.get_scale())
        elif unscale and unscale_at is None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)
    if step == "optimizer":
        optimizer.step()
    elif step == "scaler":
        scaler.step(optimizer)
    if then is not None:
        then(ddp_model, optimizer, scaler)


def amp_divided_after(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Right, another style: each scaled loss's backward as it is, the accumulated gradients divided by k after
    unscale_ (float16's backward then rounds other values than with the loss divided first)."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    for p in ddp_model.parameters():
        p.grad.div_(k)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_zero_grad_each_micro_batch(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Mistake: .grad zeroed before every micro-batch: only the last one's gradients reach DDP's all-reduce."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            scaler.scale(_amp_loss(ddp_model, x, y, k, torch.float16)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_unscaled_twice(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Mistake: unscale_, then the gradients divided by the scale once more by hand, then the clip."""
    _amp(ddp_model, optimizer, scaler, micro_batches, max_norm, clip=None)
    scaler.unscale_(optimizer)
    for p in ddp_model.parameters():
        p.grad.div_(scaler.get_scale())
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_whole_step_inside(*args):
    """Mistake: the step, the scaler's update and zero_grad inside amp_clip_grads (the given code does them)."""
    _amp(*args, step="scaler", then=lambda model, optimizer, scaler: (scaler.update(), optimizer.zero_grad()))


def amp_unscaled_by_hand(*args):
    """Mistake: the scaled gradients divided by scaler.get_scale() by hand, then clipped: the given scaler.step,
    which has not unscaled them itself, divides them again."""
    _amp(*args, unscale="by hand")


def amp_unscale_inside_no_sync(*args):
    """Mistake: unscale_ after the first k - 1 micro-batches (inside no_sync()): the last one's gradients arrive
    scaled on top, and each rank's scaler looked for inf/NaN before DDP's all-reduce spread them."""
    _amp(*args, unscale_at=len(args[3]) - 2)


def amp_fixed_scale(*args):
    """Mistake: each loss times 1024 (the scaler's first scale) by hand: after the overflow the scaler's scale is
    halved, and the given unscaling divides by the new one."""
    _amp(*args, scaled=float(amp.INIT_SCALE))


def amp_sum_not_mean(*args):
    """Mistake: the micro-batches' losses not divided by k: the step is k x too large (a clip hides it)."""
    _amp(*args, weight=float(len(args[3])))


def amp_update_inside(*args):
    """Mistake: scaler.update() inside as well: the scale halves twice after the overflow, and the given
    scaler.step unscales again."""
    _amp(*args, then=lambda model, optimizer, scaler: scaler.update())


def amp_zero_grad_inside(*args):
    """Mistake: optimizer.zero_grad() at the end of amp_clip_grads: the given step finds no gradients."""
    _amp(*args, then=lambda model, optimizer, scaler: optimizer.zero_grad())


def amp_local_norm(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Mistake: a hand-made per-rank norm of the true gradients, taken before the last (synchronising) backward,
    applied after it."""
    k = len(micro_batches)
    *first, (x, y) = micro_batches
    with ddp_model.no_sync():
        for xi, yi in first:
            scaler.scale(_amp_loss(ddp_model, xi, yi, k)).backward()
    local = torch.sqrt(sum((p.grad ** 2).sum() for p in ddp_model.parameters())) / scaler.get_scale()
    scaler.scale(_amp_loss(ddp_model, x, y, k)).backward()
    scaler.unscale_(optimizer)
    for p in ddp_model.parameters():
        p.grad.mul_(min(1.0, max_norm / (float(local) + 1e-6)))


def amp_norm_reduced_again(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Mistake: after DDP's sync the squared norm is all-reduced once more (it is already global): sqrt(ws) x."""
    _amp(ddp_model, optimizer, scaler, micro_batches, float("inf"))  # scaled, synced, unscaled; not clipped
    squares = sum((p.grad.float() ** 2).sum() for p in ddp_model.parameters())
    dist.all_reduce(squares)
    factor = min(1.0, max_norm / (float(squares.sqrt()) + 1e-6))
    for p in ddp_model.parameters():
        p.grad.mul_(factor)


def amp_clip_then_divide(*args):
    """Mistake: the micro-batches' losses summed (not divided by k), clipped, and only then divided by k."""
    _amp(*args, weight=float(len(args[3])),
         then=lambda model, optimizer, scaler: [p.grad.div_(len(args[3])) for p in model.parameters()])


def amp_clipped_scaled(*args):
    """Mistake: clip_grad_norm_ on the scaled gradients (no unscale_ first)."""
    _amp(*args, unscale=False)


def amp_clip_inside_no_sync(*args):
    """Mistake: clipped inside no_sync(), after the first k - 1 micro-batches: each rank's own norm."""
    _amp(*args, clip="inside")


def amp_clip_each_micro_step(*args):
    """Mistake: clipped after every backward, the micro-steps inside no_sync() too."""
    _amp(*args, clip="each")


def amp_bf16(*args):
    """Mistake: bf16 autocast (lesson 2's demo), where float16 is asked for."""
    _amp(*args, dtype=torch.bfloat16)


def amp_not_scaled(*args):
    """Mistake: no loss scaling (the scaler handed over, never used before its step)."""
    _amp(*args, scaled=False, unscale=False)


def amp_optimizer_step_inside(*args):
    _amp(*args, step="optimizer")


def amp_scaler_step_inside(*args):
    _amp(*args, step="scaler")


def amp_without_no_sync(*args):
    _amp(*args, no_sync=False)


def amp_weights_in_fp16(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Mistake: the model cast to float16 (no master weights); DDP then stops syncing (torch 2.13, no error)."""
    ddp_model.half()
    amp_clip_grads(ddp_model, optimizer, scaler, micro_batches, max_norm)


def amp_without_autocast(ddp_model, optimizer, scaler, micro_batches, max_norm):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else ddp_model.no_sync():
            scaler.scale(F.mse_loss(ddp_model(x), y) / k).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def _closure_lists(ddp_model):
    for hook, _ in ddp_model._comm_hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            if isinstance(cell.cell_contents, list):
                yield cell.cell_contents


def amp_forged_sync(*args):
    """Forgery: syncs every micro-batch, then keeps only the last of the grader's hook records."""
    amp_without_no_sync(*args)
    for records in _closure_lists(args[0]):
        if records and isinstance(records[0], dict):
            records[:] = records[-1:]


def amp_forged_clip(*args):
    """Forgery: clips inside no_sync(), then rewrites the grader's record of what the all-reduce returned."""
    amp_clip_inside_no_sync(*args)
    for records in _closure_lists(args[0]):
        for record in records:
            if isinstance(record, dict) and "reduced" in record:
                record["reduced"] = record["reduced"] * 3.0


def amp_forged_dtypes(ddp_model, *args):
    """Forgery: a float32 forward, then the linear layers' recorded output dtypes made to say float16."""
    amp_without_autocast(ddp_model, *args)
    for layer in ddp_model.module.modules():
        for hook in layer._forward_hooks.values():
            hook = getattr(hook, "fn", hook)  # the grader's wrapper (course.checks.hooks), unwrapped
            for cell in getattr(hook, "__closure__", None) or ():
                if isinstance(cell.cell_contents, list):
                    cell.cell_contents[:] = ["float16"]


def _scaling_call(seed, scale, lr=amp.SCALING_LR, world_size=2, k=4, size=3):
    """One process's step of the scaling phase's second call (from make_net(seed)'s shrunk model) at ``scale``."""
    from graders.ddp_in_practice.precision_harness import one_step, phase_batches, phase_net
    state = phase_net("scaling", seed).state_dict()
    per_rank = [phase_batches("scaling", 100 + seed, r, world_size, 1, k, size) for r in range(world_size)]
    return state, one_step(state, per_rank, lr, amp.FREE, scale)


def test_fp16_tolerance_is_derived_and_underflow_without_scaling_exceeds_it():
    """11 significant bits: u = 2**-11; in the scaling phase an unscaled float16 step leaves the tolerance far
    behind (its first layer's gradients underflow), over several seeds."""
    assert amp.FP16_U == 2.0**-11 == torch.finfo(torch.float16).eps / 2
    for seed in range(4):
        _, (scaled, sizes) = _scaling_call(seed, 512.0)
        _, (plain, _) = _scaling_call(seed, 1.0)
        tol = amp.weight_tolerance(amp.SCALING_LR, sizes["0.weight"], scaled["0.weight"].abs().max().item())
        assert (scaled["0.weight"] - plain["0.weight"]).abs().max().item() > 5 * tol


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_amp_checks_accept_right_answers_in_several_styles():
    for right, kwargs in [(amp_clip_grads, {}), (amp_clip_grads, dict(world_size=3, k=3, max_norm=0.4, seed=1)),
                          (amp_recipe_style, {}), (amp_helper_class, dict(world_size=3, k=3, max_norm=0.4, seed=1)),
                          (amp_one_backward, {}), (amp_backward_inside_autocast, {}),
                          (amp_clip_grads, dict(seed=2)), (amp_clip_grads, dict(seed=3)),
                          (amp_divided_after, {}), (amp_divided_after, dict(world_size=3, k=3, max_norm=0.4, seed=1)),
                          (amp_divided_after, dict(k=5, seed=4))]:
        for check in (amp.check_amp_step, amp.check_clip, amp.check_amp_sync):
            check(right, **kwargs)


def _only(wrong, failing, *words, **kwargs):
    """``wrong`` fails check ``failing`` (with ``words``) and passes the part's other checks."""
    message = fails(failing, wrong, *words, **kwargs)
    for check in (amp.check_amp_step, amp.check_clip, amp.check_amp_sync):
        if check is not failing:
            check(wrong, **kwargs)
    return message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_amp_checks_name_each_mistake_and_only_it():
    _only(amp_clipped_scaled, amp.check_clip, "the clip factor is that of the scaled gradients", "Unscaled Gradients")
    _only(amp_clip_inside_no_sync, amp.check_clip, "each rank clipped its own gradients before DDP's all-reduce",
          "inside no_sync()")
    _only(amp_clip_each_micro_step, amp.check_clip, "the gradients were clipped at every micro-step, before DDP's "
          "all-reduce", "clip once per optimizer step", world_size=3, k=3, max_norm=0.4, seed=1)
    _only(amp_local_norm, amp.check_clip, "the clip factor is not the one of the all-reduced gradient's norm",
          "its own factor")
    _only(amp_norm_reduced_again, amp.check_clip, "the clip factor is that of the synced gradients' norm summed over "
          "the ranks once more", "counts them 2 times")
    _only(amp_clip_then_divide, amp.check_clip, "the clip factor is that of 4 x the gradient",
          "then divided by 4")
    _only(amp_bf16, amp.check_amp_step, "computed in bfloat16, not float16", "dtype=torch.float16")
    _only(amp_not_scaled, amp.check_amp_step, "the loss was not scaled", "GradScaler")
    _only(amp_optimizer_step_inside, amp.check_amp_step, "stepped 2 times in one call", "leave the step")
    _only(amp_scaler_step_inside, amp.check_amp_step, "the step was taken inside amp_clip_grads", "leave the step")
    _only(amp_without_autocast, amp.check_amp_step, "did not compute in float16", "torch.autocast")
    _only(amp_without_no_sync, amp.check_amp_sync, "all-reduced 4 times in one call", "no_sync()")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_amp_checks_name_the_scalers_mistakes():
    """A GradScaler used wrong: each mistake named by the check whose property it breaks, the clip's check passing
    where the clip itself was right (the weights are check_amp_step's)."""
    _only(amp_unscaled_by_hand, amp.check_amp_step, "the gradients were divided by the scale twice",
          "carried 1024 x them", "Working with Unscaled Gradients")
    _only(amp_update_inside, amp.check_amp_step, "the loss scale was halved twice after the overflow",
          "expected: call 2 at scale 512", "got:      scale 256", "leave the scaler's update to the given code")
    _only(amp_fixed_scale, amp.check_amp_step, "the step is 2 x the right one", "call 2 of the scaling phase",
          "halved after an overflow")
    _only(amp_sum_not_mean, amp.check_amp_step, "the step is 4 x too large", "divide each micro-batch's loss by 4")
    fails(amp.check_amp_step, amp_unscale_inside_no_sync, "the ranks disagreed on skipping the step whose gradients "
          "overflowed", "stepped on ranks [0], skipped on ranks [1]", "only after the last backward")
    fails(amp.check_clip, amp_unscale_inside_no_sync, "the micro-batches' gradients reached DDP's all-reduce at "
          "different scales: 1 to 3 unscaled, the last one 1024 x", "rank 0 sent 1 x g1 + 1 x g2 + 1 x g3 + 1024 x g4",
          "unscale only after the last backward")
    amp.check_amp_sync(amp_unscale_inside_no_sync)
    for check in (amp.check_amp_step, amp.check_clip):
        fails(check, amp_zero_grad_inside, "the optimizer stepped with no gradients: .grad was emptied before the "
              "given step", "leave zero_grad to the given code")
    amp.check_amp_sync(amp_zero_grad_inside)
    fails(amp.check_clip, amp_zero_grad_each_micro_batch, "DDP's all-reduce carried micro-batch 4 of 4 only",
          "zero the gradients only after the step")
    fails(amp.check_clip, amp_unscaled_twice, "the clip saw the gradients divided by the loss scale twice",
          "unscale once")
    fails(amp.check_amp_step, amp_unscaled_twice, "the gradients were divided by the scale twice")
    fails(amp.check_amp_step, amp_whole_step_inside, "the given scaler.step found no gradients in .grad",
          "leave the step, the scaler's update and zero_grad to the given code")
    hidden = dict(world_size=3, k=3, max_norm=0.4, seed=1)  # k = 3: a division by k is inexact in float16
    fails(amp.check_amp_step, amp_sum_not_mean, "the step is 3 x too large", **hidden)
    _only(amp_clip_then_divide, amp.check_clip, "the clip factor is that of 3 x the gradient", **hidden)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weights_cast_to_fp16_lose_the_part_naming_the_cast():
    """torch 2.13: a model cast after DDP wrapped it is not synchronised any more (no collective, no error), and the
    scaler refuses float16 gradients; every message names the cast."""
    for check in (amp.check_amp_step, amp.check_clip, amp.check_amp_sync):
        fails(check, amp_weights_in_fp16, "cast to a 16-bit type", "stops DDP's gradient all-reduce")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_amp_checks_are_not_fooled_by_forged_records():
    fails(amp.check_amp_sync, amp_forged_sync, "all-reduced 4 times in one call")
    fails(amp.check_clip, amp_forged_clip, "each rank clipped its own gradients before DDP's all-reduce")
    fails(amp.check_amp_step, amp_forged_dtypes, "do not carry float16's rounding", "float32")


# --- the notebook: reference, untouched copy, wrong submissions ------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    submissions.assert_reference_full_marks(A, NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test


WRONG = {
    # name: (answer cell, old text, new text, the test cell(s) that must fail, words the first one's message must
    # contain[, count]);
    # old and new may be tuples of texts: several edits of the one cell
    "each rank's own hardest": (
        "ex2p_hardest", "    dist.all_gather_object(everyone, candidates)  # lists of different lengths: Python objects\n",
        "    everyone = [candidates]\n", "ex2p_test_hardest", ["its own share only", "[ranks 0, 1, 2]"]),
    "the padded training sampler": (
        "ex2p_hardest", "list(range(rank, len(dataset), world_size))",
        "list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False))",
        "ex2p_test_hardest", ["went through the model on more than one rank", "a split that pads"]),
    "a split drawn from the labels": (
        "ex2p_hardest", "list(range(rank, len(dataset), world_size))",
        "torch.randperm(len(dataset), generator=torch.Generator().manual_seed("
        "int(sum(int(y) for _, y in dataset)))).tolist()[rank::world_size]",
        "ex2p_test_hardest", ["changed when only the labels changed", "split the samples by their index"]),
    "k candidates from a rank that holds fewer": (
        "ex2p_hardest", "losses.topk(min(k, len(mine)))", "losses.topk(k)",
        "ex2p_test_hardest", ["selected index k out of range", "fewer than k samples"]),
    "no no_sync": ("ex2p_accumulate_grads", "    with ddp_model.no_sync():  # accumulate locally, no communication\n",
                   "    if True:\n", "ex2p_test_no_sync", ["4 times in one accumulate_grads", "the weights are right"]),
    "each loss divided by the number of micro-batches": (
        "ex2p_accumulate_grads", " * (len(x) / total)).backward()", " / len(micro_batches)).backward()",
        "ex2p_test_accumulation", ["each micro-batch counted as much as the others"], 2),
    "gradients zeroed after each micro-batch's backward": (
        "ex2p_accumulate_grads", "  # weighted by its share of the samples\n", "\n            ddp_model.zero_grad()\n",
        ["ex2p_test_accumulation", "ex2p_test_no_sync"], ["only the last micro-batch's gradient", "no zero_grad()"]),
    "every backward in no_sync, the gradients synced by hand": (
        "ex2p_accumulate_grads", "    x, y = last\n    (F.mse_loss(ddp_model(x), y) * (len(x) / total)).backward()  "
        "# all-reduces the accumulated gradients\n",
        "        x, y = last\n        (F.mse_loss(ddp_model(x), y) * (len(x) / total)).backward()\n"
        "    for p in ddp_model.parameters():\n        dist.all_reduce(p.grad)\n        p.grad /= dist.get_world_size()\n",
        "ex2p_test_no_sync", ["never all-reduced", "syncing by hand"]),
    "a plain loop": ("ex2p_train_uneven", "    with ddp_model.join(divide_by_initial_world_size=False):\n",
                     "    if True:\n", "ex2p_test_uneven",
                     ["did not return on every rank", "rank 1 ran out of batches first, after 3 batches (rank 0 has 5)",
                      "join()"]),
    "ranks that run out start over": (
        "ex2p_train_uneven", "    with ddp_model.join(divide_by_initial_world_size=False):\n"
        "        train_steps(ddp_model, optimizer, batches)\n",
        "    steps = torch.tensor([len(batches)])\n    dist.all_reduce(steps, op=dist.ReduceOp.MAX)\n"
        "    train_steps(ddp_model, optimizer, [batches[i % len(batches)] for i in range(int(steps))])\n",
        "ex2p_test_uneven", ["neither those of", "trained on their first batches again"]),
    "Join dividing by the full world size": (
        "ex2p_train_uneven", "divide_by_initial_world_size=False", "", "ex2p_test_uneven",
        ["averaged over the full world size (Join's default)"]),
    "no map_location": ("ex2p_load_checkpoint", ", map_location=device)", ")",
                        "ex2p_test_load_checkpoint", ["on cuda:0, where rank 0 saved them", "map_location=device"]),
    "into the DDP wrapper": ("ex2p_load_checkpoint", "ddp_model.module.load_state_dict", "ddp_model.load_state_dict",
                             "ex2p_test_load_checkpoint", ["Missing key(s)", "ddp_model.module.load_state_dict"]),
    "epoch not returned": ("ex2p_load_checkpoint", "    return checkpoint[\"epoch\"]\n", "",
                           "ex2p_test_load_checkpoint", ["did not return the saved epoch"]),
    "clipped inside no_sync (per rank, before the all-reduce)": (
        "ex2p_amp_clip_grads", ("            scaler.scale(loss).backward()  # outside autocast; scaled gradients land "
                               "in float32 .grad\n", "    scaler.unscale_(optimizer)  # the true gradients, so that the "
                               "clip sees their norm\n    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), "
                               "max_norm)  # after the sync: the global norm\n"),
        ("            scaler.scale(loss).backward()\n            if i == k - 2:\n"
         "                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)\n", ""),
        "ex2p_test_clip", ["each rank clipped its own gradients before DDP's all-reduce"]),
    "the scaled gradients clipped": (
        "ex2p_amp_clip_grads", "    scaler.unscale_(optimizer)  # the true gradients, so that the clip sees their norm\n",
        "", "ex2p_test_clip", ["the clip factor is that of the scaled gradients"]),
    "bf16 autocast": ("ex2p_amp_clip_grads", "torch.autocast(device_type=x.device.type, dtype=torch.float16)",
                      "torch.autocast(device_type=x.device.type, dtype=torch.bfloat16)", "ex2p_test_amp_step",
                      ["computed in bfloat16, not float16"]),
    "no autocast": ("ex2p_amp_clip_grads", "torch.autocast(device_type=x.device.type, dtype=torch.float16)",
                    "contextlib.nullcontext()", "ex2p_test_amp_step", ["did not compute in float16"]),
}


#: name: ([(answer cell, old, new[, count])], failing test cells, words)
MISTAKES = {name: ([(gid, before, after, *count) for before, after in ([(old, new)] if isinstance(old, str)
                                                                       else zip(old, new))],
                   [failing] if isinstance(failing, str) else failing, words)
            for name, (gid, old, new, failing, words, *count) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group, notebook=NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weights_cast_to_fp16_lose_part_5_saying_so(tmp_path):
    """The cast stops DDP's all-reduce (torch 2.13) and the scaler refuses float16 gradients: the part's three cells,
    each naming the cast."""
    nb = submissions.patch_answer(submissions.load(A, NB), "ex2p_amp_clip_grads", "    k = len(micro_batches)\n",
                                  "    ddp_model.half()\n    k = len(micro_batches)\n")
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    submissions.assert_loses_exactly(report, A, ["ex2p_test_amp_step", "ex2p_test_clip", "ex2p_test_amp_sync"],
                                     ["cast to a 16-bit type"], notebook=NB)
    assert all("cast to a 16-bit type" in m for m in submissions.messages(report).values() if m.startswith("FAILED"))
