"""What a rank writes to disk, whichever name its code reached the writing function by.

:func:`install` runs in every rank (``rank_main``) before the job's payload, the harness and the
student's objects, is unpickled. So whatever the student's code binds later (``save = torch.save`` at a
notebook's top level, ``from torch import save``, ``torch.serialization._save``) already leads past the
recorder, and patching ``torch.save`` afterwards changes nothing it sees:

* a Python audit hook sees every ``open``/``os.open`` for writing (pickle, numpy, ``torch.save`` into a
  file object, DCP's writers, a temporary file), every rename, link and truncation;
* ``torch.save`` to a path opens the file in C++, where no audit hook looks: every such save ends in
  ``torch._C.PyTorchFileWriter(path)``, which is replaced by a subclass that notes the path first.

A harness records around the student's call (:func:`recording`): every write of every thread of the
rank, apart from the grader's own (:func:`paused`, :func:`grader_thread`), as ``{"path", "how"}``
(absolute path; ``how``: "torch.save", "open", "rename", "link", "truncate"; a rename's or link's source as
``"from"``). ``before(event)`` runs
in the writing thread before the write happens (a harness may hold it there). Python's byte-code
caches and /dev, /proc, /sys are not writes of the student's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_local = threading.local()  # .busy: inside the recorder; .paused: the grader's own writes
_state: dict = {"installed": False, "events": None, "before": None, "grader_threads": set()}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_NOT_FILES = ("/dev/", "/proc/", "/sys/")


def _path(p) -> str | None:
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if isinstance(p, os.PathLike):
        p = os.fspath(p)
    return os.path.abspath(p) if isinstance(p, str) else None


def _note(how: str, raw, source=None) -> None:
    events = _state["events"]
    if events is None or getattr(_local, "busy", False) or getattr(_local, "paused", False):
        return
    if threading.get_ident() in _state["grader_threads"]:
        return
    _local.busy = True
    try:
        path = _path(raw)
        if path is None or path.startswith(_NOT_FILES) or path.endswith(".pyc") or "__pycache__" in path:
            return
        if os.path.isdir(path):  # O_TMPFILE opens the folder; the file that stays is seen when it gets a name
            return
        event = {"path": path, "how": how}
        moved_from = _path(source) if source is not None else None  # a rename's or link's source: what moved where
        if moved_from is not None:
            event["from"] = moved_from
        events.append(event)
        before = _state["before"]
        if before is not None:
            before(event)
    except Exception:  # noqa: BLE001 - the recorder must never break the code it watches
        pass
    finally:
        _local.busy = False


def _audit(name: str, args: tuple) -> None:
    if _state["events"] is None:  # the cheap common case: nobody records
        return
    if name == "open":
        mode, flags = args[1], args[2] or 0
        write = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
        if write:
            _note("open", args[0])
    elif name in ("os.rename", "os.link", "os.symlink"):
        _note(name[3:], args[1], source=args[0])
    elif name == "os.truncate":
        _note("truncate", args[0])


def install() -> None:
    """Install the recorder in this process (idempotent); it records nothing until :func:`recording`."""
    if _state["installed"]:
        return
    _state["installed"] = True
    sys.addaudithook(_audit)
    try:
        import torch
    except ImportError:
        return
    real = torch._C.PyTorchFileWriter

    class PyTorchFileWriter(real):  # type: ignore[misc, valid-type]
        def __init__(self, file_name, *args, **kwargs):
            if isinstance(file_name, (str, bytes, os.PathLike)):
                _note("torch.save", file_name)
            super().__init__(file_name, *args, **kwargs)

    PyTorchFileWriter.__module__, PyTorchFileWriter.__qualname__ = real.__module__, real.__qualname__
    PyTorchFileWriter.__doc__ = real.__doc__
    torch._C.PyTorchFileWriter = PyTorchFileWriter


@contextlib.contextmanager
def recording(before=None):
    """Record every write of this rank (all threads but the grader's) while the block runs; yields the list."""
    events: list[dict] = []
    _state["events"], _state["before"] = events, before
    try:
        yield events
    finally:
        _state["events"], _state["before"] = None, None


@contextlib.contextmanager
def paused():
    """The grader's own writes, in this thread, are not recorded."""
    old = getattr(_local, "paused", False)
    _local.paused = True
    try:
        yield
    finally:
        _local.paused = old


def grader_thread() -> None:
    """Call in a thread of the grader's: nothing it writes is recorded."""
    _state["grader_threads"].add(threading.get_ident())
