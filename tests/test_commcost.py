"""course.commcost: the hand-written ring all-reduce sums like dist.all_reduce and sends 2 (N - 1) / N x P values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import course
from course.commcost import ring_all_reduce, ring_sent

pytestmark = pytest.mark.timeout(120)


def _ring_and_all_reduce(rank, numel, all_gather):
    """This rank's values sent, its ring result and dist.all_reduce's, on whole numbers (every sum order is exact)."""
    dist.init_process_group("gloo")
    mine = torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(rank)).float()
    ring, expected = mine.clone(), mine.clone()
    sent = ring_all_reduce(ring, all_gather=all_gather)
    dist.all_reduce(expected)
    dist.destroy_process_group()
    return sent, ring, expected


def _expected_sent(numel, world_size):
    """Per rank: every chunk but (rank + 1) in the reduce-scatter, every chunk but (rank + 2) in the all-gather."""
    sizes = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    return [2 * numel - sizes[(r + 1) % world_size] - sizes[(r + 2) % world_size] for r in range(world_size)]


@pytest.mark.parametrize("numel", [4800, 1000, 2], ids=["even chunks", "uneven chunks", "an empty chunk"])
def test_the_ring_sums_like_all_reduce_and_counts_what_it_sends(numel):
    results = course.run_ranks(_ring_and_all_reduce, 3, args=(numel, True), echo=False, timeout=60)
    for rank, (_, ring, expected) in enumerate(results):
        assert torch.equal(ring, expected), f"rank {rank}: ring {ring[:6].tolist()} != all_reduce {expected[:6].tolist()}"
    sent = [s for s, _, _ in results]
    assert sent == _expected_sent(numel, 3)
    assert sum(sent) == 3 * ring_sent(numel, 3)  # 2 (N - 1) x P in all, even when the chunks are uneven
    if numel % 3 == 0:
        assert sent == [ring_sent(numel, 3)] * 3 == [6400] * 3


def test_a_ring_without_its_all_gather_is_caught_by_the_same_check():
    results = course.run_ranks(_ring_and_all_reduce, 3, args=(1000, False), echo=False, timeout=60)
    sizes = [len(c) for c in torch.arange(1000).tensor_split(3)]
    for rank, (sent, ring, expected) in enumerate(results):
        assert not torch.equal(ring, expected), f"rank {rank}: a reduce-scatter alone must not match all_reduce"
        own = (rank + 1) % 3  # the one chunk this rank summed in full
        assert torch.equal(ring.tensor_split(3)[own], expected.tensor_split(3)[own])
        assert sent == 1000 - sizes[own]  # every chunk but its own: half the traffic of the whole ring


def test_the_formula_and_a_non_contiguous_tensor():
    assert [ring_sent(12, n) for n in (1, 2, 3, 4)] == [0, 12, 16, 18]
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.ones(4, 4).t())
