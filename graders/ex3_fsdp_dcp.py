"""The grader reads the student's DCP checkpoint itself (:func:`graders.ex3_fsdp.check_checkpoint`, exercise 3).

A folder with DCP's file names is not yet a checkpoint: only ``torch.distributed.checkpoint`` reading it says
so. :func:`_read_harness` runs on as many ranks as saved it, with no student code in the job, and

1. reads every tensor of the folder whole, on each rank alone (DCP at world size 1: ``no_dist``), the way
   ``_load_state_dict_from_keys`` does;
2. reads every tensor again sharded by rows across all the ranks (DTensors on a mesh of the saved world size),
   as FSDP2 loads it;
3. writes, on rank 0, a copy of everything it read with ``dcp.save`` at world size 1: the folder the
   student's ``load_checkpoint`` is given, so a loader that reads anything but DCP's own files (a pickle of its
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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from course import checks
from course.checks import CheckFailed, expect
from graders.ex3_fsdp_model import _full, _join

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


def _read_harness(rank: int, path: str, copy_path: str) -> dict:
    """Read the checkpoint at ``path`` whole (alone) and sharded (all ranks); rank 0 writes the copy."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = _join()
    world_size = checks.REAL.get_world_size()
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
    sharded = _sharded(_Reader(path).read_metadata(), mesh, rank, world_size, dev)
    _LOAD(sharded, storage_reader=_Reader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    obs["shards"] = {k: checks.to_cpu(_TO_LOCAL(v)) for k, v in sharded.items()}
    if rank == 0:
        _SAVE(whole, storage_writer=FileSystemWriter(copy_path), planner=_CopyPlanner(), no_dist=True)
    return obs


# --------------------------------------------------------------------------- the grader's side


def _read_verdict(check: str, read: list[dict], saved: list[dict], ws: int) -> None:
    """What the grader's own DCP read of the folder found (:mod:`graders.ex3_fsdp_dcp`): the trained weights and
    SGD's momentum, whole (read at world size 1) and each rank's rows (read sharded at the saved world size)."""
    where = f"{ws}-rank job, the folder read with torch.distributed.checkpoint by the grader"
    hint = ("on every rank: model_sd, optim_sd = get_state_dict(model, optimizer); "
            "dcp.save({'model': model_sd, 'optimizer': optim_sd}, checkpoint_id=path)")
    if read[0]["error"]:
        raise CheckFailed(
            check, f"the folder save_checkpoint wrote is not a checkpoint torch.distributed.checkpoint can read ({where})",
            ranks=list(range(ws)), expected="DCP's .metadata (its index of every tensor) and the shard files it names, "
            "as dcp.save writes them", got=f"files {read[0]['files'][:8]}; dcp.load said: {read[0]['error']}",
            hint="files with DCP's names but torch.save (or pickle) content, or a .metadata from elsewhere, only your own "
            "loader reads; let DCP write the folder: " + hint)
    whole = read[0]["whole"]

    def found(want: torch.Tensor) -> str | None:
        return next((k for k, t in whole.items() if _same(t.float(), want.float())), None)

    for kind, key in (("params", "weights"), ("momentum", "momentum")):
        want = _full([obs[kind] for obs in saved])
        keys = {n: found(t) for n, t in want.items()}
        lost = [n for n, k in keys.items() if k is None]
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
            off = [n for n, k in keys.items() if not _same(obs["shards"].get(k), saved[rank][kind][n])]
            expect(not off, check, f"read sharded across the {ws} ranks that saved it, rank {rank}'s rows of "
                   f"{off[0] if off else ''} are not what rank {rank} saved ({where})", ranks=[rank],
                   expected=f"each rank's own rows of every {key} tensor", got=f"{len(off)} tensors differ",
                   hint="let every rank save its own shards with DCP: " + hint)


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=0)
