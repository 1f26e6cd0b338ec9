"""Sealing the thread that calls a student's function: a seccomp filter, the kernel's, that nothing run afterwards
can lift.

A check that asks the student to *predict* (a cost, the bytes a rank holds) must not let the answer *measure*
instead: :func:`seal` makes the calling thread, and every thread it starts, fail with EPERM to start a process
(fork, vfork, execve, a clone that is not a new thread; clone3, which glibc tries first, with ENOSYS, so glibc makes
its threads with clone) or change a resource limit, and with ``files=True`` to open a file. Linux on x86-64 or
aarch64 only; elsewhere (a student's self-check on a Mac) nothing is sealed and :func:`seal` says so.

Such a check must also keep the answer from *calling the grader's own reference* (the rule it judges the answer
against ships with the graders, and a student's process can import it, copy it by value, rebuild it from its code
object or exec its source): :func:`refuse` makes every copy of the given functions' code in the process refuse to
run, and refuses, from then on, to make a new one.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import struct
import sys
import types
from collections.abc import Callable, Iterable

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


# --- the grader's reference code, refused to the student's calls --------------------------------------------------

#: fingerprints of the code refused in this process (see :func:`refuse`), and the message a refused call raises
_REFUSED: dict[tuple, str] = {}
_REFUSED_BYTES: set[bytes] = set()
_get_objects, _FunctionType, _CodeType, _addaudithook, _compile = gc.get_objects, types.FunctionType, types.CodeType, \
    sys.addaudithook, compile  # bound at import, before any student code runs in the process


def fingerprint(code: types.CodeType) -> tuple:
    """What makes two code objects the same code wherever they were made: its bytecode, the names and constants it
    uses, its local names and the fingerprints of the code it defines; not its name, file or lines (a copy by value,
    renamed, or its source compiled anew on its own, has others). Code written independently differs in some of
    these (a docstring, a local's name), so refusing a fingerprint refuses copies only."""
    consts = tuple(fingerprint(c) if isinstance(c, _CodeType) else (type(c).__name__, repr(c)) for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, consts


def _refused(code) -> str | None:
    """The message for ``code`` if it, or code it defines, is refused; else None."""
    if not isinstance(code, _CodeType):
        return None
    if code.co_code in _REFUSED_BYTES:
        message = _REFUSED.get(fingerprint(code))
        if message:
            return message
    for const in code.co_consts:
        message = _refused(const) if isinstance(const, _CodeType) else None
        if message:
            return message
    return None


def _audit(event: str, args: tuple) -> None:
    if event == "function.__new__" or event == "exec":  # a function made from a code object; code run by exec
        message = _refused(args[0]) if args else None
        if message:
            raise RuntimeError(message)


def _stub(message: str, freevars: tuple) -> types.CodeType:
    """Code that raises RuntimeError(message), with ``freevars`` (a function's code must keep their number)."""
    module = _compile(f"def refused(*args, **kwargs):\n    raise RuntimeError({message!r})\n", "<refused>", "exec")
    code = next(c for c in module.co_consts if isinstance(c, _CodeType))
    return code.replace(co_freevars=freevars) if freevars else code


def refuse(functions: Iterable[Callable], message: str) -> int:
    """From now on, in this process, the code of ``functions`` refuses to run (raising RuntimeError(message)),
    wherever it is: every function object in the process whose code is the same (:func:`fingerprint`: the module's
    own, and copies made by value or from the code object) gets a code that raises, and a function made later from
    such code, or code exec'd that defines it (its source compiled anew), raises at once. Returns how many function
    objects were found. Call it in a rank, before the student's call that must not use them."""
    for fn in functions:
        _REFUSED[fingerprint(fn.__code__)] = message
        _REFUSED_BYTES.add(fn.__code__.co_code)
    if not getattr(_audit, "installed", False):
        _addaudithook(_audit)
        _audit.installed = True
    found = 0
    for obj in _get_objects():
        if type(obj) is _FunctionType and obj.__code__.co_code in _REFUSED_BYTES \
                and _REFUSED.get(fingerprint(obj.__code__)):
            obj.__code__ = _stub(_REFUSED[fingerprint(obj.__code__)], obj.__code__.co_freevars)
            found += 1
    return found
