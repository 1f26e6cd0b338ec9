"""Checks for exercise 3, part 3: a sharded checkpoint of ZeRO's optimizer state (syncbn_sharding.ipynb).

The save is judged on what the files hold, not on what the ranks say they moved: the save runs twice in one job,
first with every rank's share of Adam's state replaced by random values of its own, then with the trained state;
read back by the student's loader, the trained checkpoint with one rank's files taken from the first save must
differ exactly in that rank's parameters, by exactly its values. A rank that wrote state it received (point to
point, which gloo's flight recorder does not list, or gathered before the save) or recomputed shows it there. And
since a loader can hide what a file holds (one that takes each parameter from its owner's file reads nothing else),
the grader also reads the decoy save's files itself (:func:`foreign_state`): another rank's decoy values in a
rank's files were moved there, whatever the loader reads.
The checks themselves are in :mod:`graders.syncbn_sharding.checks` (``check_shard_save``, ``check_shard_load``), which the notebook
calls; here are the pieces they judge with.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import tempfile

import torch

from course import checks
from course.checks import CheckFailed, Mistake, stranded
from graders.syncbn_sharding.harness import SAVE_ROUNDS, _zero_load_harness, _zero_reference, _zero_save_harness

ZERO_ATOL = 1e-5  # float32 sums of 128-wide layers over the ranks in another order: ~2e-6 measured; decoys are >= 1 away


# =========================================================================== ZeRO: a sharded checkpoint

#: what the ranks may exchange while saving, as a share of Adam's whole state: a barrier or a few small
#: messages (file names, metadata) pass; a gather of the state (consolidate_state_dict moves every other
#: rank's share, at least half of it with 2 to 4 ranks) does not
MOVED_SHARE = 1 / 8
ADAM_MATH = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def zero_state_diff(state_dict: dict, reference: dict) -> str | None:
    """Why ``state_dict`` (what a plain Adam holds after loading) differs from ``reference``, or None."""
    state, ref_state = state_dict.get("state", {}), reference["state"]
    missing = sorted(set(ref_state) - set(state))
    if missing:
        return f"no state for parameters {missing} (of {len(ref_state)})"
    for index, ref in ref_state.items():
        for key, value in ref.items():
            got = state[index].get(key)
            if not isinstance(got, torch.Tensor) or got.shape != value.shape:
                what = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
                return f"parameter {index}: {key} is {what}, expected a tensor of shape {tuple(value.shape)}"
            if not torch.allclose(got.float(), value.float(), rtol=0, atol=ZERO_ATOL):
                return f"parameter {index}: {key} differs by {float((got.float() - value.float()).abs().max()):.3g}"
    for group, ref_group in zip(state_dict.get("param_groups", []), reference["param_groups"]):
        for key in ADAM_MATH:  # the hyperparameters that change the update (not foreach, fused, ...)
            value = ref_group.get(key)
            if group.get(key) != value and not (isinstance(value, tuple) and tuple(group.get(key) or ()) == value):
                return f"param_groups: {key} is {group.get(key)!r}, expected {value!r}"
    return None


def state_bytes(world_size: int, seed: int) -> int:
    state = _zero_reference(world_size, seed)[0]["state"]
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if t.dim() > 0)


def saved_files(check: str, save_shard, world_size: int, seed: int) -> tuple[list[str], list[dict]]:
    """One save job per (answer, world size, seed): the folder of each save (:data:`SAVE_ROUNDS`: with every rank's
    state changed to a decoy of its own, then trained) and each rank's observations."""

    def job():
        root = tempfile.mkdtemp(prefix="ddp-course-ex3-ckpt-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        folders = [os.path.join(root, name) for name in SAVE_ROUNDS]
        for folder in folders:
            os.makedirs(folder)
        nonce = int.from_bytes(os.urandom(4), "little")  # the decoys: nobody can compute them in advance
        values = checks.run(check, _zero_save_harness, world_size, args=(save_shard, folders, seed, nonce),
                            mistakes=_SAVE_MISTAKES).values
        return folders, values

    return checks.memo(check, ("zero-save", save_shard, world_size, seed), job)


def round_of(values: list[dict], name: str) -> list[dict]:
    """Each rank's observations of one save (``name``: one of :data:`SAVE_ROUNDS`)."""
    index = SAVE_ROUNDS.index(name)
    return [obs["rounds"][index] for obs in values]


def _composites(folders: list[str], values: list[dict]) -> list[str]:
    """For each rank r, a checkpoint folder made of the trained save's files, except that rank r's own files are
    those it wrote in the decoy save: what the checkpoint must be if every rank's files hold its own state, and
    only that."""
    decoy, trained = round_of(values, "decoy"), round_of(values, "trained")
    root = os.path.dirname(folders[0])
    out = []
    for rank in range(len(values)):
        folder = os.path.join(root, f"rank{rank}-decoy")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        own = set(trained[rank]["writes"])
        for name in sorted(os.listdir(folders[1])):
            path = os.path.join(folders[1], name)
            if path not in own and os.path.isfile(path):
                shutil.copyfile(path, os.path.join(folder, name))
        for path in decoy[rank]["writes"]:
            if os.path.dirname(path) == folders[0] and os.path.isfile(path):
                shutil.copyfile(path, os.path.join(folder, os.path.basename(path)))
        out.append(folder)
    return out


def loaded_state(check: str, save_shard, load_full_state, world_size: int, seed: int):
    """One load job per (answers, world size, seed), in one process: the trained checkpoint, then each rank's
    composite (:func:`_composites`), each read by load_full_state and loaded by a plain Adam."""
    folders, values = saved_files(check, save_shard, world_size, seed)
    trained = _zero_reference(world_size, seed)[1]

    def job():
        every = [folders[1], *_composites(folders, values)]
        return checks.run(check, _zero_load_harness, 1, args=(load_full_state, every, seed, trained)).values[0]

    return checks.memo(check, ("zero-load", save_shard, load_full_state, world_size, seed), job)


#: decoy values of another rank sampled (evenly over all its decoys), and how many found in a rank's files are a find
FOREIGN_SAMPLE, FOREIGN_FOUND = 64, 16
#: the most bytes of one rank's files the grader reads (a checkpoint here is a few hundred kilobytes)
READ_LIMIT = 64 * 2**20


def _patterns(value: float) -> tuple[bytes, ...]:
    """The bytes a float32 value is stored as: float32 (tensors, numpy), float64 little-endian (a cast, numpy) and
    big-endian (pickle's floats: a list of them)."""
    return struct.pack("<f", value), struct.pack("<d", value), struct.pack(">d", value)


def foreign_state(folder: str, values: list[dict]) -> dict[int, dict[int, list[int]]]:
    """What each rank's files of the decoy save (in ``folder``) hold of the other ranks' decoys, read by the
    grader itself, whatever loader the student wrote: {rank: {other rank: [parameter indices]}}.

    A decoy is random state only its own rank held, drawn there (:func:`graders.syncbn_sharding.harness._zero_save_harness`):
    its values in another rank's file were moved there. :data:`FOREIGN_SAMPLE` values sampled over all of a rank's
    decoys are looked for as stored bytes (float32, float64 either way round); :data:`FOREIGN_FOUND` found is a
    find. A decoy's float32 value in [1, 2) has 23 random bits, so one of its patterns is somewhere in a few hundred
    kilobytes by chance a few times in a hundred: a handful of chance finds among the sample, never a quarter of it,
    while a file holding the other rank's state holds all of them."""
    decoy = round_of(values, "decoy")
    found: dict[int, dict[int, list[int]]] = {}
    for rank, obs in enumerate(decoy):
        data, budget = [], READ_LIMIT
        for path in obs["writes"]:
            if os.path.dirname(path) != folder or not os.path.isfile(path) or budget <= 0:
                continue
            with open(path, "rb") as fh:
                chunk = fh.read(budget)
            budget -= len(chunk)
            data.append(chunk)
        blob = b"\0".join(data)
        for other, theirs in enumerate(values):
            if other == rank:
                continue
            owners = [int(index) for (index, _key), t in zip(theirs["held"], theirs["decoys"]) for _ in range(t.numel())]
            flat = torch.cat([t.detach().reshape(-1).float() for t in theirs["decoys"]]) if owners else torch.zeros(0)
            if flat.numel() < FOREIGN_FOUND:
                continue  # too little state to tell
            step = max(1, flat.numel() // FOREIGN_SAMPLE)
            positions = range(0, flat.numel(), step)[:FOREIGN_SAMPLE]
            hits = [i for i in positions if any(p in blob for p in _patterns(float(flat[i])))]
            if len(hits) >= FOREIGN_FOUND:
                found.setdefault(rank, {})[other] = sorted({owners[i] for i in hits})
    return found


def judge_foreign(check: str, folders: list[str], values: list[dict], where: str) -> None:
    """Fail ``check`` when a rank's files of the decoy save hold another rank's decoy state (:func:`foreign_state`):
    judged on the files, by the grader, so no loader can hide it."""
    found = foreign_state(folders[0], values)
    if not found:
        return
    rank = min(found)
    other = min(found[rank])
    raise CheckFailed(check, f"rank {rank}'s files hold Adam state of parameters that rank {other} holds: rank "
                      f"{rank} wrote state it received (a gather), not only its own {where}", ranks=sorted(found),
                      expected=f"rank {rank}'s files hold rank {rank}'s share only (read by the grader from the "
                      "files themselves, whatever load_full_state reads of them)",
                      got=f"in the save where every rank held random state of its own, rank {rank}'s files held "
                      f"rank {other}'s values for parameters {sorted(found[rank][other])}",
                      hint="a sharded save writes, on every rank, exactly what that rank's own local optimizer holds "
                      "(optimizer.optim.state): nothing gathered from the other ranks, however it is moved")


def _same_tensor(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.float(), b.float(), rtol=0, atol=ZERO_ATOL))


def _decoy_expected(state: dict, held: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """``state`` (what Adam held after loading the trained checkpoint) with each tensor that is one of a rank's trained
    tensors replaced by the decoy that rank held in the decoy save. Found by value (where the loader put it is
    check_shard_load's to judge), and bit for bit: a file's tensor reads back exactly, while two parameters of one
    shape may hold state within any tolerance of each other."""
    def swap(t):
        for trained, decoy in held:
            if isinstance(t, torch.Tensor) and t.shape == trained.shape and torch.equal(t.float(), trained.float()):
                return decoy
        return t
    return {i: {k: swap(v) for k, v in s.items()} for i, s in state.items()}


def _changed(got: dict, want: dict) -> list[int]:
    """The parameter indices whose state in ``got`` differs from ``want`` (missing on either side counts)."""
    out = []
    for i in sorted(set(got) | set(want), key=str):
        a, b = got.get(i, {}), want.get(i, {})
        if set(a) != set(b) or any(not (_same_tensor(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k])
                                   for k in b):
            out.append(i)
    return out


def judge_attribution(check: str, save_shard, load_full_state, values: list[dict], world_size: int,
                       seed: int) -> None:
    """Each rank's files hold the state that rank holds, and only that: read back by load_full_state, the
    checkpoint made of rank r's decoy-save files and the other ranks' trained-save files holds rank r's decoys
    where the trained checkpoint holds rank r's trained state, and nothing else differs."""
    where = f"({world_size}-rank job)"
    try:
        obs = loaded_state(check, save_shard, load_full_state, world_size, seed)
    except CheckFailed as err:
        raise CheckFailed(check, f"the save is judged by reading it back with load_full_state, which failed {where}: "
                          f"{err.problem}", ranks=err.ranks, got=err.got, detail=err.detail,
                          hint="make check_shard_load pass first: " + (err.hint or "")) from None
    base = obs[0]
    if "error" in base:
        raise CheckFailed(check, f"the save is judged by reading it back with load_full_state, and a plain Adam "
                          f"refused what it returned {where}", got=base["error"],
                          hint="make check_shard_load's loading work: a state dict of the form "
                          "torch.optim.Adam(model.parameters()).state_dict() returns")
    for rank in range(world_size):
        got = obs[1 + rank]
        mine = values[rank]
        held = [(t, d) for t, d in zip(mine["trained"], mine["decoys"])]
        what = (f"the checkpoint whose files come from the trained save, except rank {rank}'s, which come from a save "
                f"in which rank {rank} held other Adam state (its own decoy) {where}")
        if "state" not in got:
            raise CheckFailed(check, f"load_full_state could not read {what}", ranks=[rank],
                              expected="rank r's files read as the state rank r held when it saved, whatever it was",
                              got=got.get("load_error") or got.get("error"),
                              hint="each rank writes what its own local optimizer holds, and the loader reads "
                              "every rank's files")
        want = _decoy_expected(base["state"].get("state", {}), held)
        off = _changed(got["state"].get("state", {}), want)
        if not off:
            continue
        own = sorted({int(i) for i, _ in mine["held"]})
        others = [i for i in off if i not in own]
        followed = [i for i in off if i in own]
        if others:
            problem = (f"read back, rank {rank}'s files changed the state of parameters {others}, which other ranks "
                       f"hold: rank {rank} wrote state it received (a gather) or computed, not only its own")
        else:
            problem = (f"read back, rank {rank}'s files did not follow the state rank {rank} held (parameters "
                       f"{followed}): what it wrote was not what its optimizer held when it saved")
        raise CheckFailed(check, f"{problem} {where}", ranks=[rank],
                          expected=f"{what}: rank {rank}'s decoy state for parameters {own}, the trained state "
                          "everywhere else",
                          got=f"parameters {off} differ from that",
                          hint="a sharded save writes, on every rank, exactly what that rank's own local optimizer "
                          "holds (optimizer.optim.state), nothing received from other ranks and nothing "
                          "recomputed")


_SAVE_MISTAKES = [
    Mistake(lambda rank, text: "not been consolidated" in text,
            "rank {rank} asked the ZeroRedundancyOptimizer for its full state_dict(), which it does not hold: "
            "each rank has only its own share",
            "each rank saves what its own local optimizer holds (lesson 3: which parameters a rank's share covers)"),
    Mistake(lambda rank, text: stranded(text),
            "rank {rank} waited in a collective that the other ranks never joined ({ws}-rank job)",
            "saving a shard needs no communication: each rank writes what it already holds"),
]


def no_shared_file(check: str, values: list[dict], where: str) -> None:
    """Fail ``check`` when two ranks wrote the same file: one overwrote (or corrupted) the other's share."""
    owners: dict[str, list[int]] = {}
    for r, obs in enumerate(values):
        for path in obs["writes"]:
            owners.setdefault(path, []).append(r)
    shared = {path: ranks for path, ranks in owners.items() if len(ranks) > 1}
    if shared:
        path, ranks = next(iter(shared.items()))
        raise CheckFailed(check, f"{checks.rank_list(ranks)} wrote the same file {where}: one overwrote (or "
                          f"corrupted) the others' shares", ranks=ranks, expected="one file (or more) per rank, "
                          "named by rank", got=f"ranks {ranks} all wrote {os.path.basename(path)}",
                          hint="put the rank in the file's name, for example shard-<rank>.pt")
