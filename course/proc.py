"""Process primitives, the bottom layer: prctl, a process's name, its descriptors, killing a tree.

Owns the few things the sandbox, the launcher and the autograde workers each do to a
process of their own (libc's ``prctl`` through ctypes: Python 3.11 has no binding).
Imports nothing of the project: every package may import it.
Entry points: :func:`prctl`, :func:`set_process_name`, :func:`make_undumpable`,
:func:`close_descriptors_except`, :func:`kill_tree`, :func:`kill_group`, :func:`dies_with_caller`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 15, 36, 38

_libc = None


def libc():
    """This process's C library (ctypes, errno kept)."""
    global _libc
    if _libc is None:
        try:  # glibc's name on every Linux we run on; find_library runs `ldconfig -p` (a process per sandbox)
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc


def check_errno(result: int, what: str) -> None:
    """Raise ``OSError`` with errno's text when a libc call returned non-zero."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    check_errno(libc().prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def set_process_name(name: str) -> None:
    """Name this process as ps, top and /proc/PID/comm show it (at most 15 bytes; its command line stays)."""
    libc().prctl(PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:15]), 0, 0, 0)


def make_undumpable() -> None:
    """No other process of this uid may ptrace this one or read its memory and fds (/proc/PID/mem, fd/)."""
    prctl(PR_SET_DUMPABLE, 0)


def close_descriptors_except(keep) -> None:
    """Close every descriptor of this process but ``keep`` (a freshly forked child's cleanup).

    Only non-empty ranges are passed on: ``os.closerange(lo, lo)`` becomes close_range(lo, lo - 1), which
    closes every descriptor."""
    keep = sorted(set(keep))
    for low, high in zip([-1, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
        if low + 1 < high:
            os.closerange(low + 1, high)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux: its /proc stat; a zombie, or a process already gone, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL ``pid``'s descendants, and ``pid`` too unless ``include_self`` is False
    (all collected first, so orphans found now die too)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + ([root] if include_self else [])
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def kill_group(pid: int | None) -> None:
    """SIGKILL the process group ``pid`` leads (a session of its own: it and its children), else ``pid`` alone."""
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


#: run by :func:`dies_with_caller` before the command: the death signal, asked for in the child itself (the
#: kernel keeps it across exec), then the command in its place (same pid); ``python -I -S``: nothing else imported
_DEATH_SIGNAL_SHIM = """\
import ctypes, ctypes.util, os, sys
try:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.prctl({option}, ctypes.c_ulong(int(sys.argv[1])), 0, 0, 0)
if os.getppid() != int(sys.argv[2]):
    os._exit(1)  # the caller ended before the signal was asked for: it would never come
os.execvp(sys.argv[3], sys.argv[3:])
"""


def dies_with_caller(argv: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` as a command that gets ``sig`` when the thread that starts it ends (``PR_SET_PDEATHSIG``), however
    it ends: a process in a session of its own outlives a caller killed before its cleanup ran (SIGTERM's default,
    SIGKILL) otherwise. Start it with ``subprocess.Popen`` from a thread that outlives it (the one that waits for
    it); it is exec'd in place of a tiny shim, so its pid is the Popen's."""
    shim = _DEATH_SIGNAL_SHIM.format(option=PR_SET_PDEATHSIG)
    return [sys.executable, "-I", "-S", "-c", shim, str(int(sig)), str(os.getpid()), *argv]
