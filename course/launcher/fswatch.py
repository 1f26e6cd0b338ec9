"""What happened to the files of some folders while a job ran, seen by the kernel (inotify) from the launching process.

A job's workers run code the launcher does not trust, and whatever a worker records about itself it can also
forge. The kernel's own account of a folder cannot be forged from the workers: :class:`FolderWatch` opens an
inotify instance in this process (not in theirs) before the job starts and reads, in a thread, every creation,
write, close after writing, deletion and rename of a file in the watched folders, in order. It cannot say which
process did it; it says what was done to each name (a file written in place, or moved into place whole). The
kernel merges an event into the previous one still unread when both have the same kind and name (the rename
cookie is not compared), so judge the kinds of events a name had, never how many.
Linux only (inotify, through the C library); elsewhere, or when the kernel refuses a watch, ``events`` stays
None and ``problem`` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
from dataclasses import dataclass

#: inotify's event bits (linux/inotify.h) this watch asks for, by name
MASKS = {"modify": 0x2, "close_write": 0x8, "moved_from": 0x40, "moved_to": 0x80, "create": 0x100,
         "delete": 0x200}
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


class FolderWatch:
    """Watch ``folders`` from now until :meth:`stop`; ``events`` is then every :class:`FileEvent`, oldest first."""

    def __init__(self, folders: list[str]):
        self.events: list[FileEvent] | None = None
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
        mask = sum(MASKS.values())
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
                    self._parse(os.read(self._fd, 1 << 16))
                except BlockingIOError:
                    pass
            elif stopping:
                return

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
        self._thread.join(timeout=5)
        os.close(self._fd)
        self._fd = -1
        if self._overflow:
            self.problem = "the kernel's event queue overflowed: some of what happened was not seen"
            return None
        self.events = list(self._found)
        return self.events
