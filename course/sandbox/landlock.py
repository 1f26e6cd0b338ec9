"""Landlock: confine what a process may read and write, without root, namespaces or capabilities.

Where the sandbox cannot isolate a submission (no root and no user namespaces: a container under Docker's
default seccomp profile, which refuses ``unshare``), it still runs the submission as the grader's own user, who
owns the course folder, the other submissions and the gradebook. Landlock (Linux 5.13 and later; a container
reaches it under Docker's default profile) lets the wrapper restrict the submission's process, and everything it
starts, to a list of paths, before it runs any of its code: :func:`confine` grants reading (and running) on
``readable`` and every access on ``writable``; everything else is refused by the kernel, whoever asks. The
restriction cannot be lifted by the process (it needs no new privileges, which the wrapper sets first).

:func:`readable_except` gives the paths to grant so that everything is readable but some folders (the exercise
sources, the course folder, home folders, /tmp): Landlock grants, never denies, so it walks down from ``/`` to
the siblings of each denied folder.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct

from course.sandbox.linux import is_under

# the system calls' numbers are the same on x86-64 and aarch64 (the generic table)
_CREATE, _ADD, _RESTRICT = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
#: the access rights each ABI version handles (v2 adds REFER, v3 TRUNCATE, v5 IOCTL_DEV)
_HANDLED = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # all a rule on a file (not a folder) may grant
READ = EXECUTE | READ_FILE | READ_DIR | IOCTL_DEV


def _syscall():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall
    except (OSError, AttributeError):
        return None


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (another OS, an older kernel, Landlock off)."""
    syscall = _syscall()
    if syscall is None or os.uname().sysname != "Linux":
        return 0
    version = syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return version if version > 0 else 0


def handled(version: int) -> int:
    return _HANDLED.get(version, (1 << 16) - 1)


def confine(readable: list[str], writable: list[str]) -> int:
    """Restrict the calling thread, and every process it starts from now on, to reading ``readable`` (files and
    folders, recursively) and doing anything in ``writable``. The thread must be the process's only one, with
    no new privileges set. Paths that do not exist are left out. Returns the ABI version used (0: no Landlock
    here, nothing restricted); OSError where the kernel refused."""
    version = abi()
    if not version:
        return 0
    syscall = _syscall()
    mask = handled(version)
    attr = struct.pack("=Q", mask)
    ruleset = syscall(_CREATE, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, rights in ((readable, READ), (writable, mask)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    allowed = rights & mask & (mask if stat.S_ISDIR(os.fstat(fd).st_mode) else _FILE_RIGHTS)
                    rule = struct.pack("=Qi", allowed, fd)
                    if syscall(_ADD, ruleset, ctypes.c_uint32(_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)) != 0:
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
                finally:
                    os.close(fd)
        if syscall(_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return version


def readable_except(denied: list[str], root: str = "/") -> list[str]:
    """The files and folders to grant so that everything under ``root`` is readable but ``denied`` (and what they
    hold): each folder that holds no denied path whole, and the siblings of a denied path, down to it."""
    denied = [os.path.realpath(p) for p in denied]
    found: list[str] = []

    def walk(folder: str) -> None:
        if any(is_under(folder, d) for d in denied):
            return
        if not any(is_under(d, folder) for d in denied):
            found.append(folder)
            return
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                walk(entry.path)
            else:  # a file, or a link: granted where it leads, unless that is denied or holds a denied folder
                target = os.path.realpath(entry.path)
                if not any(is_under(target, d) or is_under(d, target) for d in denied):
                    found.append(entry.path)

    walk(os.path.realpath(root))
    return found
