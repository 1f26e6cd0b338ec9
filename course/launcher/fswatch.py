"""What happened to the files of some folders while a job ran, seen by the kernel (inotify) from the launching process.

A job's workers run code the launcher does not trust, and whatever a worker records about itself it can also
forge. The kernel's own account of a folder cannot be forged from the workers: :class:`FolderWatch` opens an
inotify instance in this process (not in theirs) before the job starts and reads, in a thread, every creation,
write, close after writing, deletion and rename of a file in the watched folders, in order. It cannot say which
process did it; it says what was done to each name (a file written in place, or moved into place whole). The
kernel merges an event into the previous one still unread when both have the same kind and name (the rename
cookie is not compared), so judge the kinds of events a name had, never how many, except where nothing of the
same kind and name can have come next in the queue (:func:`lone_moves` says where a count of moves can be short).
Linux only (inotify, through the C library); elsewhere, or when the kernel refuses a watch, ``events`` stays
None and ``problem`` says why.

Who wrote: given ``holders`` (the processes that may write, e.g. a job's workers), the watch also asks the kernel
which of them hold a file of the watched folders open for writing: at every event it sees (the opening of a file
included) it reads those processes' open files from ``/proc/<pid>/fd`` (and their flags from ``fdinfo``), in this
process, and keeps ``writers`` (pid -> the RANK its environment was started with, and the names it held open for
writing). A writer is seen only if it still holds the file when the watch looks, as soon as this thread runs
after the kernel reported the file's opening: a write that is over sooner goes unseen (exercise 4's small
checkpoint, saved in about 1 ms, was seen about half the time on a busy 2-core machine), so ``writers`` proves a
write where it names one and proves nothing where it does not; a process that did not write is never named. A
process whose open files the kernel refuses to show (made undumpable) is listed in ``hidden``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from course.proc import alive

#: inotify's event bits (linux/inotify.h) this watch asks for, by name
MASKS = {"modify": 0x2, "close_write": 0x8, "moved_from": 0x40, "moved_to": 0x80, "create": 0x100,
         "delete": 0x200}
_OPEN = 0x20  # IN_OPEN: asked for only to look for writers (not kept as an event)
_HOLDERS_EVERY = 0.1  # seconds between two looks for the processes that may write
_OVERFLOW, _IGNORED, _ISDIR = 0x4000, 0x8000, 0x40000000
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name, NUL-padded)


@dataclass(frozen=True)
class FileEvent:
    """One thing done to a file of a watched folder: ``kind`` (a key of :data:`MASKS`), the folder, the name,
    and for a rename the cookie that pairs its ``moved_from`` with its ``moved_to``."""

    kind: str
    folder: str
    name: str
    cookie: int = 0


def lone_moves(events: list[FileEvent], folder: str, name: str) -> list[FileEvent]:
    """The moves into ``folder``/``name`` whose source the watch did not see (no ``moved_from`` with their cookie:
    a file moved in from a folder not watched). The kernel queues such a move as a ``moved_to`` alone, and keeps
    two of them as one when the second comes while the first is still unread: where there are any, the number of
    moves into the name can be short of what was done. A move from a watched folder has its ``moved_from`` in
    between, and a write in place its ``modify``: those are counted exactly."""
    sources = {e.cookie for e in events if e.kind == "moved_from"}
    return [e for e in events if e.kind == "moved_to" and e.folder == folder and e.name == name
            and e.cookie not in sources]


#: how often, and how far apart, a process whose descriptors the kernel will not show is asked again before it
#: counts as hiding them: a process a zygote just forked is undumpable (as its zygote is) for the moment before its
#: first step makes it dumpable, and a look can fall in that moment (seen once in the grader container)
_UNREADABLE_RETRIES, _UNREADABLE_WAIT = 5, 0.01


#: how long stop() waits for the reading thread to drain the kernel's queue
_DRAIN_LIMIT = 60.0


def _listdir(base: str) -> list[str]:
    """``os.listdir(base)`` for /proc/PID/fd, asked again a few times while the kernel refuses it."""
    for _ in range(_UNREADABLE_RETRIES):
        try:
            return os.listdir(base)
        except PermissionError:
            time.sleep(_UNREADABLE_WAIT)
    return os.listdir(base)


class FolderWatch:
    """Watch ``folders`` from now until :meth:`stop`; ``events`` is then every :class:`FileEvent`, oldest first."""

    def __init__(self, folders: list[str], holders: Callable[[], list[int]] | None = None,
                 ranks: Callable[[int], int | None] | None = None):
        """``ranks``: where a holder's RANK is known better than from its /proc/PID/environ (None: not known
        there), e.g. a process forked from a zygote, whose environ shows the zygote's."""
        self._rank_of = ranks
        self.events: list[FileEvent] | None = None
        #: pid -> {"rank": the RANK of its environment (None: none), "names": {(folder, name) it held open to write}}
        self.writers: dict[int, dict] = {}
        self.hidden: set[int] = set()  # processes whose open files could not be read
        self._holders, self._pids, self._pids_at, self._ranks = holders, [], 0.0, {}
        self._known: dict[int, set] = {}  # pid -> its descriptors at the last look
        self._prefixes = [os.path.realpath(f).rstrip(os.sep) + os.sep for f in folders]
        self.problem = ""
        self._folders: dict[int, str] = {}
        self._found: list[FileEvent] = []
        self._overflow = False
        self._stop = threading.Event()
        self._fd = -1
        libc_name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError) as err:
            self.problem = f"no inotify here ({err})"
            return
        if fd < 0:
            self.problem = f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}"
            return
        self._fd = fd
        mask = sum(MASKS.values()) | (_OPEN if holders is not None else 0)
        for folder in folders:
            wd = libc.inotify_add_watch(fd, os.fsencode(folder), mask)
            if wd < 0:
                self.problem = f"cannot watch {folder}: {os.strerror(ctypes.get_errno())}"
                os.close(fd)
                self._fd = -1
                return
            self._folders[wd] = folder
        self._thread = threading.Thread(target=self._read_loop, name="ddp-course-folder-watch", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        while True:
            stopping = self._stop.is_set()  # read before the last look: what was queued before stop() is drained
            ready, _, _ = select.select([self._fd], [], [], 0 if stopping else 0.05)
            if ready:
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    data = b""
                if data and self._holders is not None:
                    self._look()  # first: a writer may still hold the file
                if data:
                    self._parse(data)
            elif stopping:
                return
            if self._holders is not None and time.monotonic() - self._pids_at > _HOLDERS_EVERY:
                self._refresh()

    def _refresh(self) -> None:
        try:
            self._pids = list(self._holders())
        except Exception:  # noqa: BLE001 - the next look asks again
            pass
        self._pids_at = time.monotonic()

    def _rank(self, pid: int) -> int | None:
        if pid not in self._ranks:
            rank = self._rank_of(pid) if self._rank_of is not None else None
            if rank is not None:
                self._ranks[pid] = rank
                return rank
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    for item in fh.read().split(b"\0"):
                        if item.startswith(b"RANK="):
                            rank = int(item[5:])
            except (OSError, ValueError):
                pass
            self._ranks[pid] = rank
        return self._ranks[pid]

    def _look(self) -> None:
        """Note every process of ``holders`` that holds a file of the watched folders open for writing now: each
        one's descriptors opened since the last look first (a file just opened has one), then the rest."""
        for pid in self._pids:
            base = f"/proc/{pid}/fd"
            try:
                fds = _listdir(base)
            except PermissionError:
                if alive(pid):  # a zombie's files are gone: only a live process that hides them counts
                    self.hidden.add(pid)
                continue
            except OSError:
                continue  # gone
            known = self._known.get(pid, set())
            self._known[pid] = set(fds)
            for fd in sorted(fds, key=lambda fd: fd in known):
                self._check(pid, base, fd)

    def _check(self, pid: int, base: str, fd: str) -> None:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            return
        folder = next((p for p in self._prefixes if target.startswith(p)), None)
        if folder is None:
            return
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                flags = int(next(line for line in fh if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration, ValueError):
            return
        if flags & (os.O_WRONLY | os.O_RDWR):
            name = target[len(folder):].removesuffix(" (deleted)")
            entry = self.writers.setdefault(pid, {"rank": self._rank(pid), "names": set()})
            entry["names"].add((folder.rstrip(os.sep), name))

    def _parse(self, data: bytes) -> None:
        at = 0
        names = {bit: name for name, bit in MASKS.items()}
        while at + _HEADER.size <= len(data):
            wd, mask, cookie, length = _HEADER.unpack_from(data, at)
            name = data[at + _HEADER.size: at + _HEADER.size + length].rstrip(b"\0").decode("utf-8", "replace")
            at += _HEADER.size + length
            if mask & _OVERFLOW:
                self._overflow = True
            if mask & (_IGNORED | _ISDIR) or wd not in self._folders:
                continue
            for bit, kind in names.items():
                if mask & bit:
                    self._found.append(FileEvent(kind, self._folders[wd], name, cookie))

    def stop(self) -> list[FileEvent] | None:
        """Stop watching (after reading what the kernel still holds); the events, or None with ``problem`` set."""
        if self._fd < 0:
            return None
        self._stop.set()
        # the thread drains what the kernel queued, then ends; on a loaded machine its looks at the writers' open
        # files can take seconds (closing the queue under it lost the job's last move into place: seen once)
        self._thread.join(timeout=_DRAIN_LIMIT)
        if self._thread.is_alive():
            self.problem = f"the watch had not read all the kernel's events within {_DRAIN_LIMIT:g} s"
            return None  # never a count that is short: the thread still reads from the queue, which stays open
        os.close(self._fd)
        self._fd = -1
        if self._overflow:
            self.problem = "the kernel's event queue overflowed: some of what happened was not seen"
            return None
        self.events = list(self._found)
        return self.events
