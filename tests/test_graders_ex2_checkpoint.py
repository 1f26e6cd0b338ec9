"""Exercise 2, part 4: check_checkpoint catches each mistake of a checkpoint from rank 0, on every rank, and only it.

Right and wrong save_checkpoint functions called by the check directly (the notebook-level wrong submissions are in
test_graders_ex2.py): only rank 0 writes, the file holds the plain weights and every rank's generator state in rank
order, and no rank returns before the file is complete, however the writing and the waiting are done.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist

import graders.ddp_basics.checks as ex2

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

fails = submissions.fails


def _rngs():
    """Every rank's CPU generator state, on every rank, in rank order (a collective: every rank calls it)."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    return states


def _checkpoint(ddp_model) -> dict:
    """What part 4's file holds: the plain model's weights and every rank's generator state. A collective: the
    functions below call it on every rank, before any `if rank == 0`."""
    return {"model": ddp_model.module.state_dict(), "rng": _rngs()}


def save_checkpoint(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    dist.barrier()


def save_no_barrier(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)


def save_barrier_first(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    dist.barrier()
    if rank == 0:
        torch.save(ckpt, ckpt_path)


def save_consumed_prefix(rank, ddp_model, ckpt_path):
    """Right, another API: strip DDP's prefix from the wrapper's state_dict; an all_reduce as the sync."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    ckpt = _checkpoint(ddp_model)
    if dist.get_rank() == 0:
        state = ddp_model.state_dict()
        consume_prefix_in_state_dict_if_present(state, "module.")
        tmp = ckpt_path + ".tmp"
        torch.save({**ckpt, "model": state}, tmp)
        os.replace(tmp, ckpt_path)
    dist.all_reduce(torch.zeros(1))


def save_gathered_tensors(rank, ddp_model, ckpt_path):
    """Right, another API: the states as uint8 tensors, gathered on rank 0 with dist.gather; a temporary file
    moved into place."""
    mine = torch.get_rng_state()
    states = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(mine, states, dst=0)
    if rank == 0:
        torch.save({"rng": states, "model": ddp_model.module.state_dict()}, ckpt_path + ".part")
        os.replace(ckpt_path + ".part", ckpt_path)
    dist.barrier()


def save_states_stacked(rank, ddp_model, ckpt_path):
    """Right, another layout: the states stacked in one tensor (row r is rank r's), all_gather into a tensor."""
    mine = torch.get_rng_state()
    flat = torch.empty(dist.get_world_size() * mine.numel(), dtype=mine.dtype)
    dist.all_gather_into_tensor(flat, mine)
    if rank == 0:
        torch.save({"model": ddp_model.module.state_dict(), "rng": flat.view(-1, mine.numel())}, ckpt_path)
    dist.barrier()


def save_weights_only(rank, ddp_model, ckpt_path):
    """Wrong: the lesson's checkpoint, the weights alone."""
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), ckpt_path)
    dist.barrier()


def save_rank0_state_only(rank, ddp_model, ckpt_path):
    """Wrong: rank 0's own state, once per rank: the other ranks' states never reach the file."""
    if rank == 0:
        state = torch.get_rng_state()
        torch.save({"model": ddp_model.module.state_dict(), "rng": [state] * dist.get_world_size()}, ckpt_path)
    dist.barrier()


def save_states_reversed(rank, ddp_model, ckpt_path):
    """Wrong: every rank's state, last rank first."""
    rng = _rngs()
    if rank == 0:
        torch.save({"model": ddp_model.module.state_dict(), "rng": rng[::-1]}, ckpt_path)
    dist.barrier()


def save_states_as_they_arrive(rank, ddp_model, ckpt_path):
    """Wrong: rank 0 receives the states from any source, in the order they arrive (right only when they happen
    to arrive in rank order: the grader's ranks start it out of order)."""
    mine = torch.get_rng_state()
    if rank == 0:
        states = [mine]
        for _ in range(1, dist.get_world_size()):
            buf = torch.empty_like(mine)
            dist.recv(buf)
            states.append(buf)
        torch.save({"model": ddp_model.module.state_dict(), "rng": states}, ckpt_path)
    else:
        dist.send(mine, dst=0)
    dist.barrier()


def save_state_after_drawing(rank, ddp_model, ckpt_path):
    """Wrong: a random checkpoint id drawn first moves every rank's generator on before its state is taken."""
    tag = int(torch.randint(0, 10**6, (1,)))
    rng = _rngs()
    if rank == 0:
        torch.save({"model": ddp_model.module.state_dict(), "rng": rng, "id": tag}, ckpt_path)
    dist.barrier()


def save_on_every_rank(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    torch.save(ckpt, ckpt_path)


def save_with_prefix(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save({**ckpt, "model": ddp_model.state_dict()}, ckpt_path)


def save_on_rank_1(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 1:
        torch.save(ckpt, ckpt_path)


def save_whole_model(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save({**ckpt, "model": ddp_model.module}, ckpt_path)


def save_relative_path(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, "ckpt.pt")


def save_stale_weights(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save({**ckpt, "model": {k: torch.zeros_like(v) for k, v in ckpt["model"].items()}}, ckpt_path)


_bound_save = torch.save  # bound when this module was loaded, as `save = torch.save` at a notebook's top level


def save_bound(rank, ddp_model, ckpt_path):
    """Right: torch.save through a name bound before the grader's job started."""
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        _bound_save(ckpt, ckpt_path)
    dist.barrier()


def save_bound_no_barrier(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        _bound_save(ckpt, ckpt_path)


def save_bound_every_rank(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    _bound_save(ckpt, ckpt_path)
    dist.barrier()


def save_serialization_internals(rank, ddp_model, ckpt_path):
    """Right: torch.serialization's own functions, below torch.save."""
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        with torch.serialization._open_zipfile_writer(ckpt_path) as writer:
            torch.serialization._save(ckpt, writer, __import__("pickle"), 2, False)
    dist.barrier()


def save_monitored_barrier(rank, ddp_model, ckpt_path):
    """Right, other synchronisations: gloo's monitored_barrier, then an object broadcast from rank 0."""
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    dist.monitored_barrier()
    done = [ckpt_path if rank == 0 else None]
    dist.broadcast_object_list(done, src=0)


def save_async_barrier_waited(rank, ddp_model, ckpt_path):
    """Right: an async barrier, waited for (the main thread then sits in Work.wait, outside torch's Python)."""
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    dist.barrier(async_op=True).wait()


def save_sleep_2(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    time.sleep(2)  # "long enough for the save"


def save_sleep_10(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    time.sleep(10)


def save_rank1_beside(rank, ddp_model, ckpt_path):
    ckpt = _checkpoint(ddp_model)
    torch.save(ckpt, ckpt_path if rank == 0 else f"{ckpt_path}.rank{rank}")
    dist.barrier()


def save_rank1_tmp(rank, ddp_model, ckpt_path):
    import tempfile

    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    else:
        with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as fh:
            torch.save(ckpt, fh)
    dist.barrier()


def save_rank1_pickle_in_folder(rank, ddp_model, ckpt_path):
    import pickle

    ckpt = _checkpoint(ddp_model)
    if rank == 0:
        torch.save(ckpt, ckpt_path)
    else:
        with open(os.path.join(os.path.dirname(ckpt_path), "copy.pkl"), "wb") as fh:
            pickle.dump(ddp_model.module.state_dict(), fh)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint():
    ex2.check_checkpoint(save_checkpoint)
    ex2.check_checkpoint(save_checkpoint, world_sizes=(4,), seed=1)
    fails(ex2.check_checkpoint, save_on_every_rank, "rank 1 also wrote ckpt.pt", "rank == 0")
    fails(ex2.check_checkpoint, save_with_prefix, "'module.'", "ddp_model.module.state_dict()")
    fails(ex2.check_checkpoint, save_on_rank_1, "rank 1 wrote ckpt.pt instead of rank 0")
    fails(ex2.check_checkpoint, save_whole_model, "is not plain data")
    fails(ex2.check_checkpoint, save_relative_path, "somewhere other than ckpt_path", "rank0/ckpt.pt")
    fails(ex2.check_checkpoint, save_stale_weights, "current parameters")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_wants_every_ranks_generator_state_in_rank_order():
    """Each rank's state is drawn from a seed only it knows: rank 0's file holds it only if that rank sent it."""
    ex2.check_checkpoint(save_gathered_tensors, world_sizes=(3,))
    ex2.check_checkpoint(save_states_stacked)
    fails(ex2.check_checkpoint, save_weights_only, "does not hold the two entries", "keys ['0.bias', '0.weight'")
    fails(ex2.check_checkpoint, save_rank0_state_only, "every entry of \"rng\" is rank 0's generator state",
          "[rank 1]", "collect them on rank 0")
    fails(ex2.check_checkpoint, save_states_reversed, "in the order of ranks [2, 1, 0]", "index r", world_sizes=(3,))
    for _ in range(2):  # every time, not by the luck of the arrivals
        fails(ex2.check_checkpoint, save_states_as_they_arrive, "in the order of ranks [0, 2, 1]", world_sizes=(3,))
    fails(ex2.check_checkpoint, save_state_after_drawing, "no rank's generator state as it was when save_checkpoint "
          "was called", "before anything draws a random number")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_sees_the_race_a_barrier_prevents():
    ex2.check_checkpoint(save_consumed_prefix)
    fails(ex2.check_checkpoint, save_no_barrier, "returned on rank 1 before rank 0's ckpt.pt was complete",
          "found no file", "dist.barrier() on every rank")
    fails(ex2.check_checkpoint, save_barrier_first, "before rank 0's ckpt.pt was complete", "[rank 1]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_judges_the_barrier_by_order_not_a_race():
    """A sleep instead of a barrier loses the check however long it is: rank 0's write waits until the others
    wait for it in a collective (or return), for a random time longer than the shorter sleeps."""
    fails(ex2.check_checkpoint, save_sleep_2, "returned on rank 1 before rank 0's ckpt.pt was complete",
          "found no file", "dist.barrier() on every rank")
    fails(ex2.check_checkpoint, save_sleep_10, "[rank 1]", "dist.barrier() on every rank")
    ex2.check_checkpoint(save_monitored_barrier, world_sizes=(3,))
    ex2.check_checkpoint(save_async_barrier_waited, world_sizes=(2,))  # let through at the hold's limit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_sees_every_way_of_writing():
    """torch.save bound before the job, or torch.serialization's internals: the writes are seen all the same."""
    ex2.check_checkpoint(save_bound, world_sizes=(2,))
    ex2.check_checkpoint(save_serialization_internals, world_sizes=(3,))
    fails(ex2.check_checkpoint, save_bound_no_barrier, "returned on rank 1 before rank 0's ckpt.pt was complete")
    fails(ex2.check_checkpoint, save_bound_every_rank, "rank 1 also wrote ckpt.pt", "rank == 0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_sees_other_ranks_writing_anywhere():
    fails(ex2.check_checkpoint, save_rank1_beside, "rank 1 also wrote a file", "ckpt.pt.rank1", "rank == 0")
    fails(ex2.check_checkpoint, save_rank1_tmp, "rank 1 also wrote a file", "/rank1/tmp/", ".pt", "rank == 0")
    fails(ex2.check_checkpoint, save_rank1_pickle_in_folder, "rank 1 also wrote a file", "shared/copy.pkl")
