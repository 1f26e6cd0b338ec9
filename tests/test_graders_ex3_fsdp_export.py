"""Exercise 3's second notebook (fsdp_checkpoint), part 4: check_export_parts (graders/fsdp_checkpoint/export.py).

Every rank writes its own balanced part of the full weights. Right answers in several styles (``full_tensor`` per
parameter with a greedy balance, a full state dict on every rank dealt by size, ``dist.gather`` of the local shards by
hand, a round-robin that happens to keep the bound at 3 ranks), realistic mistakes (each with the message that names
it) and forgeries (a rank writing another's part, torch patched on the ranks).
"""

from __future__ import annotations

import math
import os
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import graders.fsdp_checkpoint.export as export
import graders.fsdp_checkpoint.harness as fsdp_model

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex3-syncbn-sharding", "fsdp_checkpoint"
HIDDEN = {"world_size": 3, "width": 5, "hiddens": (4, 4, 48, 4, 48, 48, 4, 48), "seed": 1}  # the notebook's hidden test

fails = submissions.fails


def _path(folder):
    return os.path.join(folder, f"part-{dist.get_rank()}.pt")


def export_parts(model, folder):
    """The reference: full_tensor() of every parameter, largest first, on every rank; the least-loaded rank keeps it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    given = [0] * world_size
    mine = {}
    for name, p in sorted(model.named_parameters(), key=lambda item: -item[1].numel()):
        whole = p.full_tensor()
        owner = given.index(min(given))
        given[owner] += whole.numel() * whole.element_size()
        if owner == rank:
            mine[name] = whole.detach().cpu()
    torch.save(mine, _path(folder))


def export_resolved(model, folder):
    """Right, another style: the reference, saved under the folder's real path (pathlib's resolve)."""
    import pathlib

    rank, world_size = dist.get_rank(), dist.get_world_size()
    given, mine = [0] * world_size, {}
    for name, p in sorted(model.named_parameters(), key=lambda item: -item[1].numel()):
        whole = p.full_tensor()
        owner = given.index(min(given))
        given[owner] += whole.numel() * 4
        if owner == rank:
            mine[name] = whole.detach().cpu()
    torch.save(mine, pathlib.Path(folder).resolve() / f"part-{rank}.pt")


def export_dealt_by_size(model, folder):
    """Right, another style: the full state dict on every rank (no cpu_offload), dealt round by round by size."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    order = sorted(full, key=lambda k: (-full[k].numel(), k))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.save({k: full[k].clone() for k in order[rank::ws]}, _path(folder))


def export_gathered_by_hand(model, folder):
    """Right, another style: each parameter's local rows gathered to its owner with dist.gather (padded to one size),
    owners chosen greedily in the model's own order; the file written through a temporary name."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    load, mine = [0] * ws, {}
    for name, p in model.named_parameters():
        owner = min(range(ws), key=lambda r: (load[r], r))
        load[owner] += p.numel() * 4
        local = p.to_local().detach()
        rows = math.ceil(p.shape[0] / ws)
        padded = torch.zeros((rows, *p.shape[1:]), dtype=local.dtype)
        padded[:local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(ws)] if rank == owner else None
        dist.gather(padded, pieces, dst=owner)
        if rank == owner:
            mine[name] = torch.cat(pieces)[:p.shape[0]].clone()
    tmp = _path(folder) + ".tmp"
    torch.save(mine, tmp)
    os.replace(tmp, _path(folder))


def export_round_robin(model, folder):
    """Round-robin in the model's order: it keeps the bound at 3 ranks on the hidden model, not at 2 on the visible."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        whole = p.full_tensor()
        if i % ws == rank:
            mine[name] = whole
    torch.save(mine, _path(folder))


def export_alphabetical_halves(model, folder):
    """Unbalanced: the sorted names cut into world_size runs of one count."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    names = sorted(full)
    n = -(-len(names) // dist.get_world_size())
    rank = dist.get_rank()
    torch.save({k: full[k] for k in names[rank * n:(rank + 1) * n]}, _path(folder))


def export_small_ones_apart(model, folder):
    """Unbalanced: every tensor but the largest few on the last rank."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    rank, ws = dist.get_rank(), dist.get_world_size()
    order = sorted(full, key=lambda k: -full[k].numel())
    share = [order[rank]] if rank < ws - 1 else order[ws - 1:]
    torch.save({k: full[k] for k in share}, _path(folder))


def export_everything_everywhere(model, folder):
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save(full, _path(folder))


def export_rank0_all_in_one(model, folder):
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, _path(folder))


def export_rank0_writes_every_part(model, folder):
    """Rank 0 gathers (cpu_offload: only it holds the tensors) and writes every rank's part itself."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        names, ws = list(full), dist.get_world_size()
        for r in range(ws):
            torch.save({k: full[k] for k in names[r::ws]}, os.path.join(folder, f"part-{r}.pt"))


def export_dtensors(model, folder):
    state = model.state_dict()
    names, rank, ws = list(state), dist.get_rank(), dist.get_world_size()
    torch.save({k: state[k] for k in names[rank::ws]}, _path(folder))


def export_local_rows(model, folder):
    state = model.state_dict()
    torch.save({k: v.to_local() for k, v in state.items()}, _path(folder))


def export_gather_by_owner_only(model, folder):
    """Each rank gathers only the parameters it keeps: the gathers of the ranks do not match (a hang or an abort)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine = {name: p.full_tensor() for i, (name, p) in enumerate(model.named_parameters()) if i % ws == rank}
    torch.save(mine, _path(folder))


def export_gather_on_rank0_only(model, folder):
    """Rank 0 gathers the whole model for everyone; the others return: rank 0 waits in the gather."""
    if dist.get_rank() == 0:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        torch.save(full, _path(folder))


def export_swapped(model, folder):
    """A forgery: right parts, but each rank writes the next rank's file."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    order = sorted(full, key=lambda k: (-full[k].numel(), k))
    nxt = (rank + 1) % ws
    torch.save({k: full[k].clone() for k in order[nxt::ws]}, os.path.join(folder, f"part-{nxt}.pt"))


def export_beside(model, folder):
    """Right parts, plus a copy of the whole model elsewhere on rank 1."""
    export_parts(model, folder)
    if dist.get_rank() == 1:
        torch.save(get_model_state_dict(model), os.path.join(os.path.dirname(folder), "all.pt"))
    else:
        get_model_state_dict(model)


def export_forged(model, folder):
    """A forgery: torch.load and load_state_dict patched on the ranks (the check loads in its own process)."""
    torch.load = lambda *a, **k: {}
    torch.nn.Module.load_state_dict = lambda self, *a, **k: None
    torch.save({}, _path(folder))


def _most(nbytes: dict, ws: int, owner: dict) -> int:
    """The bytes of the fullest part when parameter k goes to rank owner[k]."""
    return max(sum(nbytes[k] for k in nbytes if owner[k] == r) for r in range(ws))


def test_the_test_models_tell_a_count_split_from_a_byte_split():
    """The bound of the notebook's models: sorted names cut by count, blocks dealt in turn and parameters dealt in
    turn each exceed it (2 and 3 ranks); a greedy split and a round of the parameters by size keep it; and no world
    size of the tests divides every parameter's rows (an owner chosen from this rank's own shard sizes differs)."""
    for spec, ws in (((export.WIDTH, 6, 0, export.HIDDENS), 2), ((5, 8, 1, HIDDEN["hiddens"]), 3)):
        model = fsdp_model.make_net(spec)
        nbytes = {n: p.numel() * 4 for n, p in model.named_parameters()}
        bound = export.balance_bound(nbytes, ws)
        names = sorted(nbytes)
        per = -(-len(names) // ws)
        by_size = sorted(nbytes, key=lambda k, sizes=nbytes: -sizes[k])
        assert _most(nbytes, ws, {k: names.index(k) // per for k in nbytes}) > bound
        assert _most(nbytes, ws, {k: int(k.split(".")[1]) % ws if k.startswith("blocks.") else 0 for k in nbytes}) > bound
        assert _most(nbytes, ws, {k: i % ws for i, k in enumerate(nbytes)}) > bound
        assert _most(nbytes, ws, {k: by_size.index(k) % ws for k in nbytes}) <= bound
        assert any(p.shape[0] % ws for p in model.parameters())


def export_by_block(model, folder):
    """Wrong: whole blocks dealt to the ranks in turn (embed and head to rank 0), whatever their bytes."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    rank, ws = dist.get_rank(), dist.get_world_size()
    owner = {k: int(k.split(".")[1]) % ws if k.startswith("blocks.") else 0 for k in full}
    torch.save({k: v for k, v in full.items() if owner[k] == rank}, _path(folder))


def export_by_local_bytes(model, folder):
    """Wrong: each rank balances by the bytes of ITS OWN shards, which differ from rank to rank where no world size
    divides the rows: the ranks disagree on who keeps what."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    loads, mine = [0] * ws, {}
    for name, p in model.named_parameters():  # one order on every rank: the gathers match
        whole = p.full_tensor()
        owner = loads.index(min(loads))
        loads[owner] += p.to_local().numel() * 4
        if owner == rank:
            mine[name] = whole.detach().cpu()
    torch.save(mine, _path(folder))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_export_parts_accepts_every_style():
    export.check_export_parts(export_parts)
    export.check_export_parts(export_parts, **HIDDEN)
    export.check_export_parts(export_dealt_by_size)
    export.check_export_parts(export_gathered_by_hand, world_size=3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_folder_behind_a_symbolic_link_is_the_same_folder(linked_tempdir):
    """Where the temporary folder is reached through a link (macOS), a part saved under its real path is the part."""
    export.check_export_parts(export_resolved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_export_parts_names_each_mistake():
    fails(export.check_export_parts, export_alphabetical_halves, "[rank 0]", "the parts are not balanced",
          "part-0.pt holds more than ceil(total / 2) + the largest parameter = 6,326 bytes", "8,132, 936")
    for unbalanced in (export_round_robin, export_by_block):
        fails(export.check_export_parts, unbalanced, "the parts are not balanced")
        fails(export.check_export_parts, unbalanced, "the parts are not balanced", **HIDDEN)
    fails(export.check_export_parts, export_by_local_bytes, "the ranks did not agree on which rank keeps each",
          "not this rank's own shard sizes")
    fails(export.check_export_parts, export_small_ones_apart, "the parts are not balanced", **HIDDEN)
    fails(export.check_export_parts, export_everything_everywhere, "every part holds every parameter",
          "each rank wrote the whole model")
    fails(export.check_export_parts, export_rank0_all_in_one, "[rank 1]", "rank 1 wrote no part")
    fails(export.check_export_parts, export_rank0_writes_every_part, "[rank 0]", "rank 0 wrote part-1.pt, rank 1's part")
    fails(export.check_export_parts, export_dtensors, "holds DTensor shards")
    fails(export.check_export_parts, export_local_rows, "every part holds every parameter")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_export_parts_names_a_gather_some_ranks_skip():
    start = time.monotonic()
    fails(export.check_export_parts, export_gather_by_owner_only, "the ranks did not gather together",
          "a gather that only the rank keeping that parameter calls")
    fails(export.check_export_parts, export_gather_on_rank0_only, "[rank 0]", "the ranks did not gather together",
          "rank 0 waited in a gather")
    assert time.monotonic() - start < fsdp_model.PG_TIMEOUT.total_seconds() + 30


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_export_parts_judges_the_files_itself():
    fails(export.check_export_parts, export_swapped, "[rank 0]", "rank 0 wrote part-1.pt, rank 1's part")
    fails(export.check_export_parts, export_beside, "[rank 1]", "rank 1 wrote a file besides its own part", "all.pt")
    fails(export.check_export_parts, export_forged, "every part is empty: none of the 28 parameters was exported")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gather_on_the_owner_only_loses_exactly_the_export_cell(tmp_path):
    """full_tensor() inside `if owner == rank:` leaves the ranks in different gathers: the export test loses, naming
    it, within the process-group timeout."""
    nb = submissions.patch_answer(submissions.load(A, NB), "ex3f_export_weights",
                                  "        whole = p.full_tensor()  # a collective: every rank gathers every parameter, "
                                  "in one order\n", "        whole = p.to_local()\n")
    nb = submissions.patch_answer(nb, "ex3f_export_weights", "            mine[name] = whole.detach().cpu()",
                                  "            mine[name] = p.full_tensor().detach().cpu()")
    start = time.monotonic()
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    seconds = time.monotonic() - start
    submissions.assert_loses_exactly(report, A, ["ex3f_test_export"], ["the ranks did not gather together"], notebook=NB)
    assert seconds < 2 * (fsdp_model.PG_TIMEOUT.total_seconds() + 30), f"grading took {seconds:.0f} s"
