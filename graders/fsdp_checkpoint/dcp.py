"""The grader reads the student's DCP checkpoint itself (:func:`graders.fsdp_checkpoint.check_checkpoint`, exercise 3).

A folder with DCP's file names is not yet a checkpoint: only ``torch.distributed.checkpoint`` reading it says
so. :func:`_read_harness` runs on as many ranks as saved it, with no student code in the job, and

1. reads every tensor of the folder whole, on each rank alone (DCP at world size 1: ``no_dist``), the way
   ``_load_state_dict_from_keys`` does;
2. reads every tensor again sharded by rows across all the ranks (DTensors on a mesh of the saved world size),
   as FSDP2 loads it;
3. writes, on rank 0, a copy of everything it read with ``dcp.save`` at world size 1: the folder the
   student's ``load_for_finetune`` is given, so a loader that reads anything but DCP's own files (a pickle of its
   own beside them, shards named by rank) fails, and the loader must reshard.

The folder is the student's: nothing in it may run code here. ``.metadata`` is unpickled with DCP's own
classes only (:class:`_MetadataUnpickler`), tensors are read with ``torch.load(weights_only=True)`` (DCP's
own way) and the other values (an optimizer's ``lr``...) are copied as raw bytes, never unpickled.

:func:`_read_verdict`, in the grader's process, finds the trained weights and SGD's momentum among the tensors
read, by value (whatever the keys the student chose: ``model.``, ``app.model.``, an optimizer's integer ids).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from course import checks
from course.checks import CheckFailed, expect
from graders.fsdp_checkpoint.harness import _full, _join

# In a rank this module is imported while the job's payload is unpickled: what it uses is torch's own.
_LOAD = dcp.load
_SAVE = dcp.save
_FROM_LOCAL = DTensor.from_local
_TO_LOCAL = DTensor.to_local

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
_OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def _enum_member(cls, name):
    """What ``getattr(cls, name)`` means in DCP's metadata: a member of one of its enums, by name (some Pythons
    pickle an enum member as that call); nothing else."""
    import enum

    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ in _DCP_MODULES
            and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"it asks for {getattr(cls, '__name__', cls)!s}.{name}, which is not a member of "
                                     "one of DCP's enums")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's unpickler that builds DCP's metadata classes (and torch.Size, dtypes, paths, members of DCP's
    enums) and nothing else."""

    def find_class(self, module, name):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        allowed = ((module in _DCP_MODULES and not name.startswith("__")) or (module, name) in _PATHS | _OTHERS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP's metadata never holds")
        return super().find_class(module, name)


class _Reader(FileSystemReader):
    """DCP's FileSystemReader, but .metadata is unpickled with :class:`_MetadataUnpickler` and must name files
    inside the folder."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        for info in (metadata.storage_data or {}).values():
            where = str(getattr(info, "relative_path", ""))
            if not where or os.sep in where or "/" in where or where.startswith("."):
                raise ValueError(f".metadata points at {where!r}, not a file of the checkpoint's folder")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WholePlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the saved state dict from the metadata, every tensor whole; other values stay raw bytes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], io.BytesIO(value.getvalue()))


class _CopyPlanner(DefaultSavePlanner):
    """DCP's save planner, writing a raw-bytes value (from :class:`_WholePlanner`) exactly as it was saved."""

    def transform_object(self, write_item, object):  # noqa: A002 - DCP's own name
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            object.seek(0)
            return object
        return super().transform_object(write_item, object)


def _failure(exc: BaseException) -> str:
    """What went wrong, in one line: a CheckpointException's first cause (it holds each rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        exc = cause[0] if isinstance(cause, tuple) else cause
    text = f"{type(exc).__name__}: " + " ".join(line.strip() for line in str(exc).strip().splitlines())
    return text[:300] + (" ..." if len(text) > 300 else "")


def _sharded(metadata: Metadata, mesh, rank: int, world_size: int, dev) -> dict[str, torch.Tensor]:
    """An empty DTensor for every tensor of the checkpoint, rows sharded over the mesh (torch.chunk's split)."""
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        size, dtype = tuple(meta.size), meta.properties.dtype
        if not size:
            out[key] = _FROM_LOCAL(torch.zeros((), dtype=dtype, device=dev), mesh, [Replicate()], run_check=False)
            continue
        rows = torch.arange(size[0]).chunk(world_size)
        local = len(rows[rank]) if rank < len(rows) else 0
        stride = tuple(int(s) for s in torch.empty(size).stride())
        empty = torch.zeros((local, *size[1:]), dtype=dtype, device=dev)
        out[key] = _FROM_LOCAL(empty, mesh, [Shard(0)], run_check=False, shape=torch.Size(size), stride=stride)
    return out


#: how far :func:`nudge` moves each value of the copy the loader is given (uniform in +-NUDGE)
NUDGE = 0.1


def nudge(key: str, shape, nonce: int) -> torch.Tensor:
    """What the grader adds to the tensor ``key`` of the checkpoint before giving it to the student's loader: values
    drawn from ``nonce`` (the grader's, drawn anew for every check) and the key, so that only reading the checkpoint
    gives them; replaying the training cannot."""
    import zlib

    g = torch.Generator().manual_seed((nonce * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 62))
    return (torch.rand(tuple(shape), generator=g) * 2 - 1) * NUDGE


def _chunks(metadata: Metadata) -> dict[str, list[dict]]:
    """Per tensor of the checkpoint, the pieces .metadata says it was saved in: offsets, sizes and the file holding it."""
    storage = metadata.storage_data or {}
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            out[key] = [{"offsets": [int(o) for o in c.offsets], "sizes": [int(n) for n in c.sizes],
                         "file": str(getattr(storage.get(MetadataIndex(key, c.offsets)), "relative_path", ""))}
                        for c in meta.chunks]
    return out


def _read_harness(rank: int, path: str, copy_path: str, nonce: int, _world_size=checks.REAL.get_world_size) -> dict:
    """Read the checkpoint at ``path`` whole (alone) and sharded (all ranks); rank 0 writes the copy, every tensor
    moved by :func:`nudge`."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = _join()
    world_size = _world_size()
    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    whole: dict = {}
    planner = _WholePlanner()
    try:
        _LOAD(whole, storage_reader=_Reader(path), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - what DCP said is the observation
        error = _failure(exc).replace(path, "path")
        index = os.path.join(path, ".metadata")
        with contextlib.suppress(OSError), open(index, "rb") as file:
            if file.read(4) == b"PK\x03\x04":
                error = f".metadata is a zip archive, as torch.save writes, not DCP's index; {error}"
        return {"files": files, "error": error}
    whole = planner.original_state_dict  # dcp.load fills a dict of its own: the planner holds it
    tensors = {k: v for k, v in planner.state_dict.items() if isinstance(v, torch.Tensor)}  # by DCP's key
    obs = {"files": files, "error": None, "whole": {k: checks.to_cpu(v) for k, v in tensors.items()}}
    mesh = init_device_mesh(dev.type, (world_size,))
    metadata = _Reader(path).read_metadata()
    sharded = _sharded(metadata, mesh, rank, world_size, dev)
    _LOAD(sharded, storage_reader=_Reader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    obs["shards"] = {k: checks.to_cpu(_TO_LOCAL(v)) for k, v in sharded.items()}
    if rank == 0:
        obs["chunks"] = _chunks(metadata)
        with torch.no_grad():
            for key, t in tensors.items():  # the same tensors as in `whole`
                if t.is_floating_point() and t.dim() > 0:
                    t.add_(nudge(key, t.shape, nonce).to(t.dtype))
        _SAVE(whole, storage_writer=FileSystemWriter(copy_path), planner=_CopyPlanner(), no_dist=True)
    return obs


# --------------------------------------------------------------------------- the grader's side


def _read_verdict(check: str, read: list[dict], saved: list[dict], ws: int) -> dict[str, dict[str, str]]:
    """What the grader's own DCP read of the folder found (:mod:`graders.fsdp_checkpoint.dcp`): the trained weights and
    SGD's momentum, whole (read at world size 1) and each rank's rows (read sharded at the saved world size).
    Returns where it found them: {"params" / "momentum": {parameter name: the checkpoint's keys holding it}} (a
    checkpoint may hold a tensor twice, say an average of the weights beside them, still equal after two steps)."""
    where = f"{ws}-rank job, the folder read with torch.distributed.checkpoint by the grader"
    hint = ("on every rank: the model's and the optimizer's state dicts from get_state_dict, saved together in one "
            "dict with dcp.save to the folder it is given")
    if read[0]["error"]:
        raise CheckFailed(
            check, f"the folder save_checkpoint wrote is not a checkpoint torch.distributed.checkpoint can read ({where})",
            ranks=list(range(ws)), expected="DCP's .metadata (its index of every tensor) and the shard files it names, "
            "as dcp.save writes them", got=f"files {read[0]['files'][:8]}; dcp.load said: {read[0]['error']}",
            hint="files with DCP's names but torch.save (or pickle) content, or a .metadata from elsewhere, only your own "
            "loader reads; let DCP write the folder: " + hint)
    whole = read[0]["whole"]
    found_keys: dict[str, dict[str, list[str]]] = {}

    def found(want: torch.Tensor) -> list[str]:
        return [k for k, t in whole.items() if _same(t.float(), want.float())]

    for kind, key in (("params", "weights"), ("momentum", "momentum")):
        want = _full([obs[kind] for obs in saved])
        keys = {n: found(t) for n, t in want.items()}
        lost = [n for n, k in keys.items() if not k]
        if lost and kind == "momentum" and len(lost) == len(keys):
            raise CheckFailed(check, f"save_checkpoint did not save the optimizer's state ({where})", ranks=list(range(ws)),
                              expected="SGD's momentum_buffer of every parameter beside the weights",
                              got=f"no tensor of the checkpoint is a momentum; it holds {sorted(whole)[:6]}",
                              hint="save the model's AND the optimizer's state dicts: " + hint)
        if lost:
            near = [k for k in whole if k.endswith(lost[0]) or k.endswith(f"{lost[0]}.momentum_buffer")]
            got = f"{near[0]} holds other values" if near else f"no such tensor; it holds {sorted(whole)[:6]}"
            raise CheckFailed(check, f"the checkpoint does not hold the trained {key} of {len(lost)} parameters, e.g. "
                              f"{lost[0]} ({where})", ranks=list(range(ws)),
                              expected=f"the {key} of every parameter when save_checkpoint was called", got=got,
                              hint="save the state the model and optimizer hold now: " + hint)
        for rank, obs in enumerate(read):
            off = [n for n, ks in keys.items() if not any(_same(obs["shards"].get(k), saved[rank][kind][n]) for k in ks)]
            expect(not off, check, f"read sharded across the {ws} ranks that saved it, rank {rank}'s rows of "
                   f"{off[0] if off else ''} are not what rank {rank} saved ({where})", ranks=[rank],
                   expected=f"each rank's own rows of every {key} tensor", got=f"{len(off)} tensors differ",
                   hint="let every rank save its own shards with DCP: " + hint)
        found_keys[kind] = keys
    return found_keys


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=0)


def _moved(where: str, moves: list[tuple[str, str]]) -> str:
    """Where a file written at ``where`` ended up after the job's renames (a file, or a folder it lies in, moved into
    place: a checkpoint written to a temporary name and renamed when complete), in order."""
    for src, dst in moves:
        if where == src or where.startswith(src.rstrip(os.sep) + os.sep):
            where = dst + where[len(src.rstrip(os.sep)):]
    return where


def written_in(saved: list[dict], path: str) -> list[set[str]]:
    """Per rank, the names of the files it wrote that lie in the folder ``path`` once the save is done: its recorded
    writes moved by every rank's renames, compared by real path (a temporary folder behind a symbolic link, as
    macOS's is, names the same folder twice)."""
    moves = [tuple(m) for obs in saved for m in obs.get("moves", [])]
    folder = os.path.realpath(path)
    out = []
    for obs in saved:
        names = set()
        for w in obs.get("writes", []):
            final = os.path.realpath(_moved(w, moves))
            if os.path.dirname(final) == folder:
                names.add(os.path.basename(final))
        out.append(names)
    return out


def _pieces_verdict(check: str, chunks: dict[str, list[dict]], keys: dict[str, dict[str, list[str]]],
                    saved: list[dict], path: str, shapes: dict[str, tuple], ws: int) -> None:
    """Every rank's rows of every weight and momentum are a piece of their own in the checkpoint (DCP's .metadata,
    read by the grader), in a file that rank wrote (the writes the save job recorded on each rank): the state
    was saved where it lives, each rank its own shard, not gathered first."""
    where = f"{ws}-rank job, the folder's .metadata read by the grader"
    writers = written_in(saved, path)
    hint = ("save the sharded state dicts as they are, on every rank (get_state_dict's, as it returns them, into "
            "dcp.save); a full state dict "
            "(full_state_dict=True, full_tensor()) gathers every weight on every rank first")
    for kind, what in (("params", "weights"), ("momentum", "momentum")):
        for name, candidates in keys.get(kind, {}).items():
            failures = []
            for key in candidates:  # one copy of the tensor saved as every rank's shard is enough
                try:
                    _pieces_of(check, chunks, key, name, what, writers, shapes, ws, where, hint)
                except CheckFailed as failure:
                    failures.append(failure)
                else:
                    break
            else:
                if failures:
                    raise failures[0]


def _pieces_of(check, chunks, key, name, what, writers, shapes, ws, where, hint) -> None:
    """One tensor of the checkpoint (``key``) holds every rank's rows of ``name`` as a piece of their own, in a file
    that rank wrote."""
    from course.costmodel import fsdp_shard_rows

    size = list(shapes[name])
    pieces = [c for c in chunks.get(key, []) if all(n > 0 for n in c["sizes"])]
    start = 0
    for rank in range(ws):
        rows = fsdp_shard_rows(size[0], ws, rank)
        if not rows:
            continue
        want = {"offsets": [start] + [0] * (len(size) - 1), "sizes": [rows, *size[1:]]}
        start += rows
        mine = [c for c in pieces if c["offsets"] == want["offsets"] and c["sizes"] == want["sizes"]]
        if not mine:
            whole = any(c["sizes"] == size for c in pieces)
            raise CheckFailed(
                check, (f"the checkpoint holds the {what} of {name} whole, in one piece, not as each rank's "
                        f"shard: the full state was gathered before the save ({where})" if whole else
                        f"the checkpoint does not hold rank {rank}'s rows of {name} ({what}) as a piece of "
                        f"their own ({where})"),
                ranks=[rank], expected=f"rows {want['offsets'][0]}..{want['offsets'][0] + rows - 1} of {name}, "
                f"rank {rank}'s shard, saved by rank {rank}",
                got="pieces (offsets, sizes): " + ", ".join(f"{c['offsets']} {c['sizes']}" for c in pieces[:4]),
                hint=hint)
        file = mine[0]["file"]
        if file not in writers[rank]:
            by = [r for r in range(ws) if file in writers[r]]
            raise CheckFailed(
                check, f"rank {rank}'s rows of {name} ({what}) are in {file}, which rank {rank} did not write "
                f"({where})", ranks=[rank], expected="every rank's shard in a file that rank writes",
                got=(f"{file} was written by {checks.rank_list(by)}" if by else
                     f"no rank was seen writing {file} while save_checkpoint ran"), hint=hint)
