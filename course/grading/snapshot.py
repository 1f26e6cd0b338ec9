"""Record, in the student's kernel, what each check call is given, for :mod:`course.grading.verifier` to re-run it.

A sandboxed kernel (:class:`course.grading.kernel.SandboxKernelManager`) starts with
an IPython startup file that calls :func:`install`. Where a test cell
made of check calls runs (as :func:`course.grading.checkcalls.kernel_source` gives it:
one comment naming what its checks use), the hook pickles (by value, cloudpickle) every
notebook object the calls name, and the content of small files they name
("train.py"), into ``.ddp-verify/NNNNN.json`` in the work folder. The grader
reads these files as opaque data (:func:`read`): it never unpickles them;
only the sandboxed ranks of the verifier do.

The hook runs in the student's process, so a student can break it; that only
loses them the verification (and the points), never gives them any.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from dataclasses import dataclass, field

FOLDER = ".ddp-verify"
STARTUP_DIR = ".home/.ipython/profile_default/startup"
#: most bytes one snapshot (all objects of one test cell) may take; more is recorded as an error
MAX_SNAPSHOT = 64 << 20
MAX_FILE = 4 << 20


@dataclass
class Snapshot:
    """What one execution of a check cell was given (blobs stay base64 text: never unpickled here)."""

    seq: int
    source: str
    objects: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    #: what each object is, for "not written yet" without starting a job (:func:`course.checks.require_written`):
    #: its type name, "yes"/"no" for callable, and its source (functions and classes). Student-written data:
    #: a forged entry can only make the check fail its own answer, never pass it.
    kinds: dict[str, str] = field(default_factory=dict)
    callable: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    #: the notebook's cells as the kernel compiled them, {cell file: JSON [label, source]}, so a rank's
    #: traceback in the verifier shows the student's lines as "Cell In[7], line 3". Display only.
    cells: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- kernel side


def install(shell, folder: str) -> None:
    """Register the pre_run_cell hook in ``shell`` (an IPython InteractiveShell)."""
    state = {"seq": 0}

    def pre_run_cell(info=None) -> None:
        try:
            source = info.raw_cell if info is not None else shell.user_ns.get("_ih", [""])[-1]
            state["seq"] += 1
            _record(shell.user_ns, folder, state["seq"], source, shell)
        except BaseException:  # noqa: BLE001 - never disturb the student's cell
            pass

    shell.events.register("pre_run_cell", pre_run_cell)


def _record(namespace: dict, folder: str, seq: int, source: str, shell=None) -> None:
    from course.grading import checkcalls

    if checkcalls.USES_PREFIX not in source:
        return
    names, strings = checkcalls.uses(source)  # listed in the comment the kernel runs (checkcalls.kernel_source)
    from course.launcher.job import dumps

    snap = Snapshot(seq, source)
    size = 0
    for name in names:
        if name not in namespace:
            snap.errors[name] = f"`{name}` was not defined when this test ran"
            continue
        try:
            blob = dumps(namespace[name])
        except Exception as exc:  # noqa: BLE001
            snap.errors[name] = f"`{name}` cannot be pickled: {type(exc).__name__}: {exc}"[:2000]
            continue
        _describe(snap, name, namespace[name])
        size += len(blob)
        if size > MAX_SNAPSHOT:
            snap.errors[name] = f"`{name}` is too large to send to the grader (over {MAX_SNAPSHOT >> 20} MB)"
            continue
        snap.objects[name] = base64.b64encode(blob).decode()
    _record_cells(snap, shell)
    for text in strings:
        if _plain_relative(text) and os.path.isfile(text) and os.path.getsize(text) <= MAX_FILE:
            with open(text, "rb") as fh:
                snap.files[text] = base64.b64encode(fh.read()).decode()
    path = os.path.join(folder, f"{seq:05d}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(snap.__dict__, fh)
    os.replace(path + ".tmp", path)


def _record_cells(snap: Snapshot, shell) -> None:
    import linecache

    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    size = 0
    for name, number in list(numbers.items()):
        entry = linecache.cache.get(name)
        if not (isinstance(entry, tuple) and len(entry) == 4 and is_cell_file(str(name))):
            continue
        text = "".join(entry[2])
        size += len(text)
        if size > MAX_FILE:
            break
        snap.cells[str(name)] = json.dumps([f"Cell In[{number}]", text])


def is_cell_file(name: str) -> bool:
    """A notebook cell's file as ipykernel names it (``/tmp/ipykernel_123/456.py``), nothing else."""
    return bool(re.fullmatch(r"[^\0\n]*/ipykernel_\d+/\d+\.py", name))


def install_cells(cells: dict[str, str]) -> None:
    """In the verifier: make the kernel's cells known to linecache and the launcher (for rank tracebacks)."""
    import linecache

    from course import launcher

    for name, data in cells.items():
        try:
            label, text = json.loads(data)
        except (ValueError, TypeError):
            continue
        if not (is_cell_file(name) and isinstance(label, str) and isinstance(text, str)
                and re.fullmatch(r"Cell In\[\d+\]", label)):
            continue
        lines = text.splitlines(keepends=True)
        linecache.cache[name] = (len(text), None, lines, name)
        launcher.configure(cell_names={name: label})


def _describe(snap: Snapshot, name: str, obj) -> None:
    from course.grading.student import answer_source

    snap.kinds[name] = type(obj).__name__
    snap.callable[name] = "yes" if callable(obj) else "no"
    source = answer_source(obj)
    if source is not None and len(source) <= MAX_FILE:
        snap.sources[name] = source


def _plain_relative(path: str) -> bool:
    """A file name inside the work folder (no absolute path, no ``..``)."""
    return bool(path) and not os.path.isabs(path) and ".." not in path.replace("\\", "/").split("/")


# --------------------------------------------------------------------------- grader side


def prepare(box) -> None:
    """Before the kernel starts: an empty snapshot folder and the startup file that installs the hook."""
    folder = box.fresh_dir(FOLDER)
    startup = box.fresh_dir(STARTUP_DIR)
    with open(os.path.join(startup, "00-ddp-course-verify.py"), "w") as fh:
        fh.write("import course.grading.snapshot as _ddp_snapshot\n"
                 f"_ddp_snapshot.install(get_ipython(), {folder!r})\n"
                 "del _ddp_snapshot\n")


def read(workdir: str, limit: int = 4 * MAX_SNAPSHOT) -> list[Snapshot]:
    """The snapshots the kernel left in ``workdir`` (call it once the kernel is dead), by sequence number.

    The files come from untrusted code: links are not followed, sizes are capped,
    anything malformed is skipped.
    """
    folder = os.path.join(workdir, FOLDER)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    found, total = [], 0
    try:
        for name in sorted(os.listdir(fd)):
            if not (name.endswith(".json") and name[:-5].isdigit()):
                continue
            try:
                file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            with os.fdopen(file_fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    continue
                data = fh.read(limit - total + 1)
            total += len(data)
            if total > limit:
                break
            try:
                raw = json.loads(data)
                snap = Snapshot(int(name[:-5]), str(raw["source"]),
                                *({str(k): str(v) for k, v in dict(raw.get(key) or {}).items()}
                                  for key in ("objects", "errors", "files", "kinds", "callable", "sources",
                                              "cells")))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            found.append(snap)
    finally:
        os.close(fd)
    return sorted(found, key=lambda s: s.seq)
