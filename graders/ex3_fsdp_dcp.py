"""The grader reads the student's DCP checkpoint itself (exercise 3's FSDP notebook, :func:`graders.ex3_fsdp.check_checkpoint`).

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
"""

from __future__ import annotations

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
from graders.ex3_fsdp_model import _join

# In a rank this module is imported while the job's payload is unpickled: what it uses is torch's own.
_LOAD = dcp.load
_SAVE = dcp.save
_FROM_LOCAL = DTensor.from_local
_TO_LOCAL = DTensor.to_local

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
_OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's unpickler that builds DCP's metadata classes (and torch.Size, dtypes, paths) and nothing else."""

    def find_class(self, module, name):
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
    """What went wrong, in one line (a CheckpointException holds the cause's traceback: its last line)."""
    lines = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
    text = lines[-1] if len(lines) > 1 and ("Error" in lines[-1] or "Exception" in lines[-1]) else lines[0]
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
        out[key] = _FROM_LOCAL(torch.zeros((local, *size[1:]), dtype=dtype, device=dev), mesh, [Shard(0)], run_check=False,
                               shape=torch.Size(size), stride=stride)
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
        return {"files": files, "error": _failure(exc).replace(path, "path")}
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
