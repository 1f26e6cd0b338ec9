"""Part 4 of exercise 3's FSDP notebook: an export every rank writes a part of (:func:`check_export_parts`).

``export_parts(model, folder)`` is called on every rank with the trained sharded model. Afterwards ``folder`` holds
``part-<rank>.pt`` for every rank, each a ``torch.save`` dict of plain full tensors keyed by the plain model's
parameter names: every parameter in exactly one part, the parts together loading into a plain :class:`Net` with
``strict=True`` and holding the trained weights, and no part holding more than ``ceil(T / world_size) + M`` bytes
(``T`` the bytes of all the parameters, ``M`` those of the largest; a parameter counts its elements times 4, float32).

What the grader judges it reads itself: every file each rank wrote while ``export_parts`` ran, however it wrote it (the
harness records them, :func:`course.checks.record_writes`; only files still there afterwards count, so a temporary
file renamed into place is fine), and the parts, loaded in the grader's process with ``weights_only=True``. The test
model's blocks differ in size (``hiddens``): a split by the number of parameters (half of the names each) exceeds the
bound, any split that balances bytes (the least-loaded rank takes the next parameter, or a round of the parameters
sorted by size) keeps it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile

import torch
from torch.distributed.tensor import DTensor

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed, rank_list, stranded
from graders.fsdp_checkpoint.checks import _job_env, _where
from graders.fsdp_checkpoint.harness import _export_harness, _full, _max_diff, make_net

#: the visible test's model: blocks of other sizes, so that balancing by bytes matters (a split by the number of
#: parameters, by block or by parameter in turn each exceeds the bound), and a width no world size divides (each rank's
#: shard of a parameter is another size, so an owner chosen from this rank's own shard sizes is not the same everywhere)
WIDTH, HIDDENS = 7, (64, 4, 64, 4, 4, 4)

_GATHER_HINT = ("a full tensor is gathered from every rank's rows: full_tensor(), a full state dict and all_gather are "
                "collectives, so every rank gathers every parameter, in one order, and only then keeps its own share")

_EXPORT_MISTAKES = [
    Mistake(lambda rank, text: stranded(text) or "deadlocked" in text or "did not match the collective" in text,
            "the ranks did not gather together ({ws}-rank job): rank {rank} waited in a gather that the other ranks "
            "did not join, or joined with another tensor; gathering a parameter is a collective, so a gather that only "
            "the rank keeping that parameter calls hangs",
            _GATHER_HINT, expected="every rank takes part in every gather, in the same order; each then writes its own "
            "share"),
]


def part_name(rank: int) -> str:
    return f"part-{rank}.pt"


def balance_bound(nbytes: dict[str, int], ws: int) -> int:
    """The most bytes one part may hold: ceil(total / world size) + the largest parameter's bytes."""
    return math.ceil(sum(nbytes.values()) / ws) + max(nbytes.values())


def _first_error(text: str) -> str:
    """load_state_dict's error without its header line, on one line, cut to 300 characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading"):
        lines = lines[1:]
    flat = " ".join(lines)
    return flat[:300] + (" ..." if len(flat) > 300 else "")


def _writes_verdict(check: str, values: list[dict], folder: str, ws: int) -> None:
    """Each rank left exactly one file, its own part; every rank left one."""
    where = _where(ws)
    own = [os.path.realpath(os.path.join(folder, part_name(r))) for r in range(ws)]  # real paths: see written_in
    writes = [[os.path.realpath(w) for w in obs["writes"]] for obs in values]
    for rank in range(ws):
        left = [w for w in writes[rank] if os.path.isfile(w) and w != own[rank]]
        if left:
            other = left[0]
            owner = own.index(other) if other in own else None
            raise CheckFailed(
                check, (f"rank {rank} wrote {part_name(owner)}, rank {owner}'s part" if owner is not None else
                        f"rank {rank} wrote a file besides its own part") + f" ({where})", ranks=[rank],
                expected="each rank writes its own part-<rank>.pt in `folder`, nothing else, anywhere", got=f"rank {rank} wrote " + ", ".join(
                    os.path.relpath(w, os.path.dirname(os.path.realpath(folder))) for w in left[:3]),
                hint="each rank saves only the share it keeps, under its own rank's name; the others save theirs")
    missing = [r for r in range(ws) if not (os.path.isfile(own[r]) and own[r] in writes[r])]
    if missing:
        present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        raise CheckFailed(
            check, f"{rank_list(missing)} wrote no part ({where})", ranks=missing,
            expected=f"one file per rank in `folder`: {', '.join(part_name(r) for r in range(ws))}, each written by "
            "its rank", got=f"files in the folder: {present[:8]}",
            hint="every rank writes a part: split the parameters among ALL the ranks, by bytes")


def _load_part(check: str, path: str, rank: int) -> dict:
    mesh_log = logging.getLogger("torch.distributed.device_mesh")  # a DTensor's mesh unpickled here warns
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    hint = "model.state_dict() gives each rank's DTensor shards; save plain full tensors: "
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - shown to the student
        text = f"{type(exc).__name__}: {exc}"
        shards = "DTensor" in text or "distributed" in text
        raise CheckFailed(
            check, f"{part_name(rank)} " + ("holds DTensor shards, not plain tensors" if shards else
                                            "does not load with torch.load(weights_only=True)"),
            ranks=[rank], expected="a dict of plain full tensors, keyed by parameter name",
            got=text.splitlines()[0][:300], hint=hint + _GATHER_HINT) from None
    finally:
        mesh_log.setLevel(level)
    expect(isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()),
           check, f"{part_name(rank)} holds {type(state).__name__}, not a dict of tensors keyed by parameter name",
           ranks=[rank], expected="a dict of plain full tensors, one per parameter of this rank's share", hint=hint)
    sharded = [k for k, v in state.items() if isinstance(v, DTensor)]
    expect(not sharded, check, f"{part_name(rank)} holds DTensor shards ({len(sharded)} of {len(state)} tensors), not "
           "plain full tensors", ranks=[rank], expected="plain full tensors", got=f"DTensors: {sharded[:4]}",
           hint=hint + _GATHER_HINT)
    return state


def _parts_verdict(check: str, parts: list[dict], values: list[dict], spec: tuple, ws: int) -> None:
    """The parts together: each parameter once, a plain Net loads them strictly, the trained weights, balanced."""
    where = _where(ws)
    plain = make_net(spec)
    nbytes = {name: p.numel() * 4 for name, p in plain.named_parameters()}
    owners: dict[str, list[int]] = {}
    for rank, part in enumerate(parts):
        for key in part:
            owners.setdefault(key, []).append(rank)
    twice = [k for k, ranks in owners.items() if len(ranks) > 1]
    if twice:
        everywhere = all(len(owners[k]) == ws for k in owners)
        raise CheckFailed(
            check, ("every part holds every parameter: each rank wrote the whole model" if everywhere else
                    f"{len(twice)} parameters are in more than one part, e.g. {twice[0]} in "
                    + " and ".join(part_name(r) for r in owners[twice[0]])) + f" ({where})",
            ranks=sorted({r for k in twice for r in owners[k]}), expected="every parameter in exactly one part",
            got=f"{len(twice)} of {len(owners)} parameters in several parts",
            hint="decide once, the same way on every rank, which rank keeps each parameter; each keeps only its own")
    merged = {k: v for part in parts for k, v in part.items()}
    names = [n for n, _ in plain.named_parameters()]
    missing = [n for n in names if n not in merged]
    if missing and set(merged) <= set(names):  # the plain model's names, but not all of them: no owner for some
        empty = [r for r, part in enumerate(parts) if not part]
        raise CheckFailed(
            check, (f"every part is empty: none of the {len(names)} parameters was exported" if len(empty) == ws else
                    f"{len(missing)} parameters are in no part: the ranks did not agree on which rank keeps each")
            + f" ({where})", ranks=empty or list(range(ws)), expected=f"all {len(names)} parameters, each in one part",
            got=f"no part holds {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")
            + (f"; {', '.join(part_name(r) for r in empty)} {'is' if len(empty) == 1 else 'are'} empty" if empty else ""),
            hint="decide the owner of each parameter the same way on every rank, from what every rank knows alike (the "
            "full shapes and sizes, not this rank's own shard sizes, which differ where the world size does not "
            "divide the rows); and give every rank the full tensors it keeps (with cpu_offload=True a full state dict "
            "reaches rank 0 only)")
    try:
        plain.load_state_dict(merged, strict=True)
    except RuntimeError as exc:
        text = str(exc)
        shards = "size mismatch" in text
        raise CheckFailed(
            check, "the parts together do not load into a plain (unsharded) model with load_state_dict(strict=True)"
            + (": their tensors are shards (smaller than the parameters)" if shards else "") + f" ({where})",
            ranks=list(range(ws)), expected="the keys and full shapes of a plain Net's state_dict, each in one part",
            got=_first_error(text),
            hint=("each rank holds only its rows of every parameter (to_local()): " + _GATHER_HINT if shards else
                  "every parameter of the model, under the plain model's own names (no prefix), in some part")) from None
    want = _full([obs["params"] for obs in values])
    diff = _max_diff(dict(plain.state_dict()), want)
    expect(diff <= 1e-6, check, f"the exported weights differ from the trained model's by {diff:.3g} ({where})",
           ranks=list(range(ws)), expected="the model's trained weights, gathered whole", hint=_GATHER_HINT)
    bound = balance_bound(nbytes, ws)
    held = [sum(nbytes[k] for k in part) for part in parts]
    over = [r for r in range(ws) if held[r] > bound]
    expect(not over, check, f"the parts are not balanced: {', '.join(part_name(r) for r in over)} "
           f"hold{'s' if len(over) == 1 else ''} more than ceil(total / {ws}) + the largest parameter = {bound:,} bytes "
           f"({where}, a parameter counted at 4 bytes an element)", ranks=over,
           expected=f"at most {bound:,} bytes in every part ({sum(nbytes.values()):,} bytes in all, the largest "
           f"parameter {max(nbytes.values()):,})", got="bytes per part: " + ", ".join(f"{h:,}" for h in held),
           hint="the parameters differ greatly in size: splitting them by count is not splitting the bytes; give each "
           "parameter, largest first, to the rank that holds the fewest bytes so far (the same choice on every rank)")


def check_export_parts(export_parts, world_size: int = 2, seed: int = 0, width: int = WIDTH, hiddens: tuple = HIDDENS,
                       steps: int = 2) -> None:
    """Every rank writes ``part-<rank>.pt`` in ``folder`` and nothing else; the parts hold every parameter once, as
    plain full tensors that load strictly into a plain Net with the trained weights, none over the balance bound;
    every rank takes part in every gather (a gather on some ranks only is reported within the process-group
    timeout)."""
    check = "check_export_parts"
    checks.require_written(check, export_parts=export_parts)
    spec = (width, len(hiddens), seed, tuple(hiddens))
    root = tempfile.mkdtemp(prefix="ddp-course-ex3-fsdp-")
    try:
        folder = os.path.join(root, "export")
        os.makedirs(folder)
        values = checks.run(check, _export_harness, world_size, args=(export_parts, folder, spec, steps),
                            mistakes=_EXPORT_MISTAKES, env=_job_env(world_size)).values
        _writes_verdict(check, values, folder, world_size)
        parts = [_load_part(check, os.path.join(folder, part_name(r)), r) for r in range(world_size)]
        _parts_verdict(check, parts, values, spec, world_size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed(check)
