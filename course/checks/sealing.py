"""Sealing the thread that calls a student's function: a seccomp filter, the kernel's, that nothing run afterwards
can lift.

A check that asks the student to *predict* (a cost, the bytes a rank holds) must not let the answer *measure*
instead: :func:`seal` makes the calling thread, and every thread it starts, fail with EPERM to start a process
(fork, vfork, execve, a clone that is not a new thread; clone3, which glibc tries first, with ENOSYS, so glibc makes
its threads with clone) or change a resource limit, and with ``files=True`` to open a file. Linux on x86-64 or
aarch64 only; elsewhere (a student's self-check on a Mac) nothing is sealed and :func:`seal` says so.
"""

from __future__ import annotations

import ctypes
import platform
import struct

#: per processor: (the audit architecture, the system calls refused, clone's number, clone3's number)
_NUMBERS = {
    "x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "setrlimit": 160,
                            "prlimit64": 302, "open": 2, "creat": 85, "openat": 257, "openat2": 437}, 56, 435),
    "aarch64": (0xC00000B7, {"execve": 221, "execveat": 281, "setrlimit": 164, "prlimit64": 261, "openat": 56,
                             "openat2": 437}, 220, 435),
}
_FILES = {"open", "creat", "openat", "openat2"}


def seal(*, files: bool = False) -> bool:
    """Seal the calling thread (see the module's text): True once sealed, False where this platform has no such
    filter (not Linux, another processor, a C library without prctl); OSError where the kernel refused it."""
    machine = platform.machine()
    if platform.system() != "Linux" or machine not in _NUMBERS:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    arch, numbers, clone, clone3 = _NUMBERS[machine]
    deny = [nr for name, nr in numbers.items() if files or name not in _FILES]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # [code, jt, jf, k]; a jump's targets are the names of the three returns at the end
    prog = [[ld, 0, 0, 4], [jeq, 0, "eperm", arch], [ld, 0, 0, 0]]  # another ABI's calls: refused
    if machine == "x86_64":
        prog += [[0x35, "eperm", 0, 0x40000000]]  # x32's numbers (nr | 0x40000000): refused
    prog += [[jeq, "eperm", 0, nr] for nr in deny]
    prog += [[jeq, "enosys", 0, clone3], [jeq, 0, "allow", clone], [ld, 0, 0, 16], [jset, "allow", "eperm", 0x00010000]]
    ends = {"allow": len(prog), "eperm": len(prog) + 1, "enosys": len(prog) + 2}
    prog += [[ret, 0, 0, allow], [ret, 0, 0, eperm], [ret, 0, 0, enosys]]
    raw = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        jt, jf = (ends[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        raw += struct.pack("HBBI", code, jt, jf, k)
    buffer = ctypes.create_string_buffer(raw)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = Program(len(prog), ctypes.addressof(buffer))
    if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: what an unprivileged filter needs
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if prctl(22, 2, ctypes.byref(program), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER (this thread)
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return True
