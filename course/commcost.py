"""A ring all-reduce written out with point-to-point sends, counting the values each rank sends.

Lesson 1 runs it next to ``dist.all_reduce`` to show what an all-reduce costs: a reduce-scatter
then an all-gather around a ring of ranks, each rank sending ``2 (N - 1) / N x P`` values for a
tensor of ``P`` values on ``N`` ranks::

    def work(rank):
        dist.init_process_group("gloo")
        t = torch.ones(12)
        sent = course.commcost.ring_all_reduce(t)   # t is now the sum over ranks; sent == 2 * (N - 1) / N * 12
        dist.destroy_process_group()
        return sent
"""

from __future__ import annotations


def ring_sent(numel: int, world_size: int) -> float:
    """Values each rank sends in a ring all-reduce of ``numel`` values on ``world_size`` ranks: 2 (N - 1) / N x P."""
    return 2 * (world_size - 1) / world_size * numel


def ring_all_reduce(tensor, *, all_gather: bool = True) -> int:
    """Sum ``tensor`` over all ranks, in place, the ring way; return how many values this rank sent.

    ``all_gather=False`` stops after the reduce-scatter: each rank then holds the full sum of one
    chunk only (not an all-reduce).
    """
    import torch.distributed as dist

    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor; pass tensor.contiguous()")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)  # N views (sizes differ by at most 1): writing one writes tensor
    sent = 0

    def exchange(outgoing, incoming):
        """Send one chunk to the right while receiving one from the left; count what was sent."""
        nonlocal sent
        # both ops in one batch, so that under nccl two ranks sending to each other first cannot deadlock;
        # an empty chunk (fewer values than ranks) is skipped by sender and receiver alike
        ops = []
        if outgoing.numel():
            ops.append(dist.P2POp(dist.isend, outgoing, right))
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, left))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        sent += outgoing.numel()

    # reduce-scatter: in step s, pass chunk (rank - s) on and add the chunk the left neighbour passes;
    # after N - 1 steps chunk (rank + 1) has collected every rank's values: this rank holds its full sum
    for step in range(world_size - 1):
        arriving = chunks[(rank - step - 1) % world_size]
        incoming = arriving.new_empty(arriving.shape)
        exchange(chunks[(rank - step) % world_size], incoming)
        arriving += incoming

    # all-gather: N - 1 more steps pass the fully summed chunks around the ring, each overwriting the old copy
    if all_gather:
        for step in range(world_size - 1):
            exchange(chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size])
    return sent
