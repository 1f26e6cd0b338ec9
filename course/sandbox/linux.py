"""The Linux pieces of the sandbox: namespaces and mounts (libc through ctypes), cgroups, killing by uid.

prctl, process names, descriptors and killing a process tree are :mod:`course.proc`'s (below every package).

Used by :mod:`course.sandbox` (the grader side) and :mod:`course.sandbox.wrapper`
(the wrapper that starts a submission's process). Python 3.11 has no
``os.unshare``, hence ctypes.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from course.envnames import TOKEN_ENV
from course.proc import check_errno, libc
from course.sandbox.limits import GiB

if TYPE_CHECKING:
    from course.sandbox.limits import Limits

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18


def unshare(flags: int) -> None:
    check_errno(libc().unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    check_errno(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
                f"mount {target}")


def loopback_up() -> None:
    """Bring ``lo`` up (a new network namespace starts with it down): ioctl, or iproute2's ``ip``."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP, IFF_RUNNING = 0x8913, 0x8914, 0x1, 0x40
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH22x", b"lo", 0)
            flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP | IFF_RUNNING))
        return
    except OSError:
        pass
    ip = shutil.which("ip") or "/sbin/ip"
    if os.system(f"{ip} link set lo up >/dev/null 2>&1") != 0:
        raise OSError("cannot bring the loopback interface up (no ioctl, no iproute2)")


def _probe_in_child(steps) -> tuple[bool, str]:
    """Run ``steps()`` in a forked child (namespaces entered there leave this process as it was):
    (whether it succeeded, the error it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        code = 0
        try:
            steps()
        except BaseException as exc:  # noqa: BLE001
            os.write(w, str(exc).encode()[:500])
            code = 1
        os._exit(code)
    os.close(w)
    message = os.read(r, 1000).decode(errors="replace")
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, message


_namespace_probe: tuple[bool, str] | None = None


def namespaces_available() -> tuple[bool, str]:
    """(whether this process may create network and mount namespaces, why not). Probed once, in a child."""
    global _namespace_probe
    if _namespace_probe is None:
        if os.geteuid() != 0:
            _namespace_probe = (False, "not root")
        else:
            def steps():
                unshare(CLONE_NEWNET | CLONE_NEWNS)
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                loopback_up()

            ok, message = _probe_in_child(steps)
            _namespace_probe = (ok, "" if ok else f"root, but namespaces are not allowed here ({message})")
    return _namespace_probe


def enter_user_namespace(flags: int) -> None:
    """``unshare(CLONE_NEWUSER | flags)`` without root: this user's uid and gid mapped to themselves.

    The caller holds every capability inside the new user namespace (so it may mount, bring up
    loopback in its own network namespace) until it execs a program, which then runs as this user
    with no capabilities at all; outside, the kernel sees the same unprivileged uid as before."""
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)


_rootless_probe: tuple[bool, str] | None = None


def rootless_available() -> tuple[bool, str]:
    """(whether this non-root process may isolate without root: new user, network, mount and pid namespaces
    with loopback up and tmpfs mounts, why not). Probed once, in a child."""
    global _rootless_probe
    if _rootless_probe is None:
        if os.geteuid() == 0:
            _rootless_probe = (False, "root: the full sandbox applies")
        else:
            def steps():
                enter_user_namespace(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID)
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k")
                loopback_up()
                # pid 1 of the new pid namespace (the next fork) must be able to mount its own /proc
                ok, _ = _probe_in_child(lambda: mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC))
                if not ok:
                    raise OSError("a new /proc cannot be mounted for the pid namespace")

            ok, message = _probe_in_child(steps)
            _rootless_probe = (ok, "" if ok else f"not root, and user namespaces are not allowed here ({message})")
    return _rootless_probe


# --------------------------------------------------------------------------- cgroups


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path for ``controller`` (v1), or its v2 path when ``controller`` is None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if controller is None and hid == "0" and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    return None


@dataclass
class Cgroups:
    """The cgroup folders of one sandbox (v2: one; v1: memory and pids) and what they limit."""

    paths: list[str] = field(default_factory=list)
    memory: str = ""  # how memory is limited, for the summary

    @classmethod
    def create(cls, name: str, limits: Limits) -> Cgroups:
        made = cls()
        try:
            made._create_v2(name, limits) or made._create_v1(name, limits)
        except OSError:
            made.remove()
            made = cls()
        return made

    def _create_v2(self, name: str, limits: Limits) -> bool:
        root = Path("/sys/fs/cgroup")
        own = _own_cgroup(None)
        if own is None or not (root / "cgroup.controllers").is_file():
            return False
        parent = root / own.lstrip("/")
        wanted = {"memory", "pids"}
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not wanted <= enabled:
            try:
                (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted - enabled))
            except OSError:
                return False
        _remove_stale(parent, name)
        path = parent / name
        path.mkdir()
        self.paths.append(str(path))
        (path / "memory.max").write_text(str(limits.memory))
        try:
            (path / "memory.swap.max").write_text("0")
        except OSError:
            pass
        (path / "pids.max").write_text(str(limits.nproc))
        self.memory = f"cgroup v2 memory.max {limits.memory / GiB:g} GiB"
        return True

    def _create_v1(self, name: str, limits: Limits) -> bool:
        root = Path("/sys/fs/cgroup")
        mem_own = _own_cgroup("memory")
        if mem_own is None or not (root / "memory").is_dir():
            return False
        mem = root / "memory" / mem_own.lstrip("/") / name
        _remove_stale(mem.parent, name)
        mem.mkdir()
        self.paths.append(str(mem))
        (mem / "memory.limit_in_bytes").write_text(str(limits.memory))
        try:
            (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory))
        except OSError:
            pass
        pids_own = _own_cgroup("pids")
        if pids_own is not None and (root / "pids").is_dir():
            try:
                pids = root / "pids" / pids_own.lstrip("/") / name
                _remove_stale(pids.parent, name)
                pids.mkdir()
                self.paths.append(str(pids))
                (pids / "pids.max").write_text(str(limits.nproc))
            except OSError:
                pass
        self.memory = f"cgroup v1 memory limit {limits.memory / GiB:g} GiB"
        return True

    def memory_record(self) -> dict | None:
        """The memory cgroup's own record of this sandbox, read from the kernel's files (None without one):
        ``{"limit": bytes, "peak": bytes or None, "hit": times the limit was reached, "oom_kills": processes the
        kernel killed for it or None where the kernel does not count them}``. What proves the cap: the cgroup, not
        the process, says the limit was reached and use stayed within it."""
        for path in self.paths:
            folder = Path(path)
            if (folder / "memory.max").is_file():  # v2
                events = dict(line.split() for line in (folder / "memory.events").read_text().splitlines())
                peak = folder / "memory.peak"
                return {"limit": int((folder / "memory.max").read_text()),
                        "peak": int(peak.read_text()) if peak.is_file() else None,
                        "hit": int(events.get("max", 0)), "oom_kills": int(events.get("oom_kill", 0))}
            if (folder / "memory.limit_in_bytes").is_file():  # v1
                oom = dict(line.split() for line in (folder / "memory.oom_control").read_text().splitlines())
                return {"limit": int((folder / "memory.limit_in_bytes").read_text()),
                        "peak": int((folder / "memory.max_usage_in_bytes").read_text()),
                        "hit": max(int(f.read_text()) for f in (folder / "memory.failcnt",
                                                                  folder / "memory.memsw.failcnt") if f.is_file()),
                        "oom_kills": int(oom["oom_kill"]) if "oom_kill" in oom else None}
        return None

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.paths:
            try:
                found.update(int(p) for p in Path(path, "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def kill(self) -> None:
        for path in self.paths:
            try:
                Path(path, "cgroup.kill").write_text("1")  # v2, Linux >= 5.14
            except OSError:
                pass
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        for path in reversed(self.paths):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self.paths = []


def _remove_stale(parent: Path, name: str) -> None:
    """Remove the cgroups that earlier sandboxes of the same uid could not (they still held unreaped
    processes then). ``name`` is "ddp-sandbox-UID-TOKEN"; whoever creates it holds UID's lock, so no
    other sandbox uses a cgroup of that uid."""
    prefix = name.rsplit("-", 1)[0] + "-"
    try:
        stale = [p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    except OSError:
        return
    for path in stale:
        try:
            if not Path(path, "cgroup.procs").read_text().split():
                os.rmdir(path)
        except OSError:
            pass  # in use by a running sandbox, or not ours to remove


# --------------------------------------------------------------------------- killing


def uid_processes(uid: int, zombies: bool = False) -> list[int]:
    """Pids whose real uid is ``uid``: live ones (zombies hold nothing and their parent reaps them),
    zombies too with ``zombies=True`` (until reaped they still count against RLIMIT_NPROC and pids.max)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                zombie = False
                for line in fh:
                    if line.startswith(b"State:"):
                        zombie = line.split()[1] in (b"Z", b"X")
                    elif line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid and (zombies or not zombie):
                            found.append(int(entry.name))
                        break
        except (OSError, ValueError, IndexError):
            pass
    return found


def kill_uid(uid: int, deadline: float = 10.0) -> bool:
    """SIGKILL every process of ``uid``; True when none is left.

    A child that becomes ``uid`` and calls kill(-1, SIGKILL) signals all of them
    at once (the kernel walks the task list under a lock forks must wait for,
    so even a fork bomb cannot outrun it). It is done before looking: scanning
    /proc while hundreds of processes spin takes seconds.
    """
    end = time.monotonic() + deadline
    while True:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            except BaseException:  # noqa: BLE001
                os._exit(1)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.02)
        if not uid_processes(uid):
            return True
        if time.monotonic() > end:
            return False


def marked_processes(token: str) -> list[int]:
    """Pids of this user whose environment carries ``token`` (strays of a non-root sandbox)."""
    import psutil

    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            pass
    del psutil
    return found


def is_under(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or inside it (both absolute, normalised)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def blocking_ancestor(path: str) -> str | None:
    """The outermost folder above ``path`` that other users cannot enter (e.g. /root, mode 0700), if any."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        folder = os.path.join(*parts[:i])
        try:
            if not os.stat(folder).st_mode & 0o001:
                return folder
        except OSError:
            return None
    return None
