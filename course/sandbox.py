"""Run a submission's code (its kernel, its ranks, the grader's re-run of its checks) in a sandbox.

The grader side is :class:`Sandbox`: it picks a dedicated unprivileged uid
for one submission, prepares its memory/pids cgroup and its work folder, wraps
a command line in ``python -m course.sandbox run ... -- CMD`` and, when the
submission is done, kills everything the sandbox started. The wrapper (this
module's ``run``), when it runs as root, puts ``CMD`` in a new network
namespace (loopback only: ranks still rendezvous on 127.0.0.1) and a private
mount namespace where the paths a submission must not see (the exercises'
sources, the nbgrader course folder, .git) are covered by empty read-only
tmpfs mounts and /tmp, /dev/shm are private; it sets rlimits, joins the
cgroup, and execs ``CMD`` as the sandbox uid with no new privileges. It stays
behind as a small supervisor (a child subreaper) that kills whatever is left
when ``CMD`` ends. Not root (an instructor's laptop), it can only apply
rlimits and the work folder: :attr:`Sandbox.summary` then says "sandbox:
partial" and why, and grading reports it.

:class:`SandboxKernelManager` is a jupyter_client kernel manager that starts
its kernel this way (usable as nbclient's and nbgrader's
``kernel_manager_class``); the kernel talks to the client over unix sockets
(ZMQ ``ipc``) in the work folder, which cross the network namespace.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import pwd
import resource
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20

#: uids handed to sandboxes (no passwd entry); one per concurrently graded submission
UID_RANGE = range(61000, 61512)
#: environment marker of every sandboxed process (used to find strays when not root)
TOKEN_ENV = "DDP_COURSE_SANDBOX"
#: folders inside the work folder that the sandbox machinery owns
KERNEL_DIR = ".kernel"
HOME_DIR = ".home"

_FORCE_PARTIAL_ENV = "DDP_COURSE_SANDBOX_PARTIAL"  # tests: behave as when not root


@dataclass
class Limits:
    """Resource limits of one sandbox (all processes of one submission together, where the OS allows)."""

    #: bytes of memory for the whole sandbox (cgroup); a kernel, its forkserver and 4 gloo ranks
    #: training a small DDP model use ~0.8 GB (measured: 250 MB kernel, 290 MB forkserver,
    #: 4 x 15-100 MB ranks sharing the forkserver's pages)
    memory: int = 3 * GiB
    #: bytes of address space per process, used only when no cgroup is available (torch ranks map ~1 GB)
    address_space: int = 6 * GiB
    #: processes + threads of the sandbox uid (a kernel + 4 ranks use ~60)
    nproc: int = 512
    #: CPU seconds per process
    cpu_seconds: int = 1800
    #: largest file a sandboxed process may write
    file_size: int = 512 * MiB
    open_files: int = 4096
    #: size of the private /tmp and /dev/shm (counted in ``memory`` too)
    tmp_size: int = 1 * GiB


# --------------------------------------------------------------------------- libc


_libc = None


def _libc_handle():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 36, 38


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc_handle().unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc_handle().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(_libc_handle().prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def make_undumpable() -> None:
    """No other process of this uid may ptrace this one or read its memory and fds (/proc/PID/mem, fd/)."""
    prctl(PR_SET_DUMPABLE, 0)


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


_namespace_probe: tuple[bool, str] | None = None


def namespaces_available() -> tuple[bool, str]:
    """(whether this process may create network and mount namespaces, why not). Probed once, in a child."""
    global _namespace_probe
    if _namespace_probe is None:
        if os.geteuid() != 0:
            _namespace_probe = (False, "not root")
        else:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                os.close(r)
                code = 0
                try:
                    unshare(CLONE_NEWNET | CLONE_NEWNS)
                    mount(None, "/", None, MS_REC | MS_PRIVATE)
                    loopback_up()
                except BaseException as exc:  # noqa: BLE001
                    os.write(w, str(exc).encode()[:500])
                    code = 1
                os._exit(code)
            os.close(w)
            message = os.read(r, 1000).decode(errors="replace")
            os.close(r)
            _, status = os.waitpid(pid, 0)
            ok = os.waitstatus_to_exitcode(status) == 0
            _namespace_probe = (ok, "" if ok else f"root, but namespaces are not allowed here ({message})")
    return _namespace_probe


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
        path = parent / name
        path.mkdir(exist_ok=True)
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
        mem.mkdir(exist_ok=True)
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
                pids.mkdir(exist_ok=True)
                self.paths.append(str(pids))
                (pids / "pids.max").write_text(str(limits.nproc))
            except OSError:
                pass
        self.memory = f"cgroup v1 memory limit {limits.memory / GiB:g} GiB"
        return True

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
        for _ in range(200):
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


# --------------------------------------------------------------------------- killing


def uid_processes(uid: int) -> list[int]:
    """Pids whose real uid is ``uid``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            found.append(int(entry.name))
                        break
        except (OSError, ValueError):
            pass
    return found


def kill_uid(uid: int, deadline: float = 10.0) -> bool:
    """SIGKILL every process of ``uid``; True when none is left.

    A child that becomes ``uid`` and calls kill(-1, SIGKILL) signals all of them
    at once (the kernel walks the task list under a lock forks must wait for,
    so even a fork bomb cannot outrun it).
    """
    end = time.monotonic() + deadline
    while True:
        if not uid_processes(uid):
            return True
        if time.monotonic() > end:
            return False
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


def _marked_processes(token: str) -> list[int]:
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


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (collected first, so orphans found now die too)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


# --------------------------------------------------------------------------- the grader side


def _lock_dir() -> Path:
    for candidate in (Path("/run/ddp-course-sandbox"), Path(tempfile.gettempdir()) / "ddp-course-sandbox-locks"):
        try:
            candidate.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no folder for the sandbox uid locks")


def _free_uid() -> tuple[int, int]:
    """(uid, fd of its lock): a uid of UID_RANGE with no passwd entry that no other sandbox holds."""
    folder = _lock_dir()
    for uid in UID_RANGE:
        try:
            pwd.getpwuid(uid)
            continue  # a real account: never use it
        except KeyError:
            pass
        fd = os.open(folder / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if not kill_uid(uid):  # leftovers of a grader that died
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            continue
        return uid, fd
    raise RuntimeError(f"all {len(UID_RANGE)} sandbox uids are in use")


def default_hidden() -> list[str]:
    """What a submission never sees, whatever the course: this checkout's exercise sources and .git."""
    repo = Path(__file__).resolve().parent.parent
    return [str(repo / name) for name in ("exercises", ".git") if (repo / name).exists()]


def python_paths() -> list[str]:
    """What sandboxed Python needs to reach: the interpreter, its libraries, this package's checkout."""
    import site
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             str(Path(__file__).resolve().parent.parent)}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:
        pass
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def _python_flags() -> list[str]:
    # Never import from the current folder: it may be a submission's.
    return ["-P"] if sys.version_info >= (3, 11) else ["-I"]


class Sandbox:
    """One submission's sandbox, seen from the grader: wrap commands in it, then kill all it started.

    ``with Sandbox(workdir, hide=[...]) as box: subprocess.run(box.command([...]))``.
    ``workdir`` is the submission's own folder; it is handed to the sandbox uid
    while the sandbox is open and given back afterwards.
    """

    def __init__(self, workdir: str | os.PathLike, *, hide=(), limits: Limits | None = None, isolate: bool | None = None):
        self.workdir = os.path.realpath(workdir)
        self.hide = [os.path.realpath(p) for p in [*default_hidden(), *hide]]
        self.limits = limits or Limits()
        self.token = uuid.uuid4().hex
        self.uid: int | None = None
        self._lock_fd: int | None = None
        self.cgroups = Cgroups()
        self.pids: list[int] = []  # supervisors started with our commands (for the non-root sweep)
        self._owner: tuple[int, int] | None = None
        self.opened = False
        if isolate is None:
            isolate = os.environ.get(_FORCE_PARTIAL_ENV) != "1"
        ok, why = namespaces_available() if isolate else (False, f"{_FORCE_PARTIAL_ENV}=1")
        self.isolated = ok
        self.why_partial = why

    # -- lifecycle

    def open(self) -> Sandbox:
        if self.opened:
            return self
        os.makedirs(self.workdir, exist_ok=True)
        st = os.stat(self.workdir)
        self._owner = (st.st_uid, st.st_gid)
        if self.isolated:
            self.uid, self._lock_fd = _free_uid()
            self.cgroups = Cgroups.create(f"ddp-sandbox-{self.uid}", self.limits)
            _chown_tree(self.workdir, self.uid, self.uid, only_from=None)
            os.chmod(self.workdir, 0o700)
        self.opened = True
        return self

    def __enter__(self) -> Sandbox:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def kill(self) -> None:
        """SIGKILL every process the sandbox started (bounded: a few seconds at most)."""
        for pid in self.pids:  # the supervisors (root when isolated) and what they still hold
            kill_tree(pid)
        self.pids = []
        if self.isolated and self.uid is not None:
            self.cgroups.kill()
            kill_uid(self.uid)
        else:
            for _ in range(3):
                strays = _marked_processes(self.token)
                if not strays:
                    break
                for pid in strays:
                    kill_tree(pid)

    def close(self) -> None:
        if not self.opened:
            return
        try:
            self.kill()
        finally:
            self.cgroups.remove()
            if self.uid is not None and self._owner is not None:
                _chown_tree(self.workdir, *self._owner, only_from=self.uid)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            self.uid = None
            self.opened = False

    # -- commands

    @property
    def summary(self) -> str:
        """One line saying what protects the grader from this submission."""
        if self.isolated:
            memory = self.cgroups.memory or f"RLIMIT_AS {self.limits.address_space / GiB:g} GiB per process"
            return (f"sandbox: full (uid {self.uid}, no network, sources and course files hidden, "
                    f"{memory}, at most {self.limits.nproc} processes)")
        return (f"sandbox: partial, {self.why_partial}: the submission runs as this user with rlimits in its own "
                "folder, but can read this user's files (exercise sources included) and use the network")

    def env(self) -> dict[str, str]:
        """Environment variables every sandboxed process gets (its home and caches inside the work folder)."""
        home = os.path.join(self.workdir, HOME_DIR)
        return {
            "HOME": home,
            "IPYTHONDIR": os.path.join(home, ".ipython"),
            "MPLCONFIGDIR": os.path.join(home, ".matplotlib"),
            "JUPYTER_RUNTIME_DIR": os.path.join(self.workdir, KERNEL_DIR),
            "JUPYTER_DATA_DIR": os.path.join(home, ".jupyter-data"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(home, ".inductor"),
            "XDG_CACHE_HOME": os.path.join(home, ".cache"),
            TOKEN_ENV: self.token,
        }

    def fresh_dir(self, relative: str) -> str:
        """An empty folder ``relative`` to the work folder, owned by the sandbox uid.

        Whatever the submission put at that name (a folder, a file, a symbolic link
        to somewhere else) is removed first, without following links: the grader
        runs as root and must never be steered out of the work folder.
        """
        path = self.workdir
        for part in Path(relative).parts:
            path = os.path.join(path, part)
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
                os.unlink(path)
        if os.path.lexists(path):
            shutil.rmtree(path)
        os.makedirs(path)
        if self.uid is not None:
            sub = self.workdir
            for part in Path(relative).parts:
                sub = os.path.join(sub, part)
                os.chown(sub, self.uid, self.uid, follow_symlinks=False)
        return path

    def command(self, argv: list[str], workdir: str | None = None) -> list[str]:
        """``argv`` wrapped so that it runs inside this sandbox."""
        if not self.opened:
            self.open()
        lim = self.limits
        cmd = [sys.executable, *_python_flags(), "-m", "course.sandbox", "run",
               "--workdir", workdir or self.workdir, "--token", self.token,
               "--nproc", str(lim.nproc), "--cpu", str(lim.cpu_seconds), "--fsize", str(lim.file_size),
               "--nofile", str(lim.open_files), "--tmp-size", str(lim.tmp_size)]
        if self.isolated:
            cmd += ["--isolate", "--uid", str(self.uid)]
            for path in self.hide:
                cmd += ["--hide", path]
            for path in python_paths():
                cmd += ["--expose", path]
            for path in self.cgroups.paths:
                cmd += ["--cgroup", path]
        if not self.cgroups.paths:
            cmd += ["--address-space", str(lim.address_space)]
        for key, value in self.env().items():
            cmd += ["--env", f"{key}={value}"]
        return [*cmd, "--", *argv]


def _chown_tree(path: str, uid: int, gid: int, only_from: int | None) -> None:
    """lchown ``path`` and everything under it (never following links); ``only_from``: only what that uid owns."""
    def one(p: str) -> None:
        try:
            if only_from is None or os.lstat(p).st_uid == only_from:
                os.chown(p, uid, gid, follow_symlinks=False)
        except OSError:
            pass

    one(path)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            one(os.path.join(root, name))


# --------------------------------------------------------------------------- the wrapper (runs as `python -m course.sandbox run`)


def _is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _cover(target: str, keep: dict[str, int], *, read_only: bool, size: str) -> None:
    """Mount an empty tmpfs over ``target`` (a file: /dev/null), then bind back the ``keep`` paths inside it.

    ``keep`` maps paths to O_PATH descriptors opened before anything was covered.
    """
    if os.path.isdir(target) and not os.path.islink(target):
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={'0755' if read_only else '1777'}")
        for path, fd in sorted(keep.items()):
            if _is_under(path, target) and path != target:
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        if read_only:
            mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
    elif os.path.exists(target):
        mount("/dev/null", target, None, MS_BIND)
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _blocking_ancestor(path: str) -> str | None:
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


def _loopback_names() -> None:
    """/etc/hosts with names for ::1 and ::ffff:127.0.0.1 too: without them, reverse lookups of the
    ranks' loopback connections go to DNS, which fails in the namespace, and torch warns on stderr."""
    try:
        with open("/etc/hosts") as fh:
            text = fh.read()
    except OSError:
        text = "127.0.0.1 localhost\n"
    path = "/tmp/.ddp-course-hosts"
    with open(path, "w") as fh:
        fh.write(text.rstrip("\n") + "\n::1 localhost ip6-localhost\n::ffff:127.0.0.1 localhost\n")
    os.chmod(path, 0o644)
    if os.path.exists("/etc/hosts"):
        mount(path, "/etc/hosts", None, MS_BIND)
        mount(None, "/etc/hosts", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _isolate(args) -> None:
    """New network + mount namespaces: loopback up, hidden paths covered, private /tmp and /dev/shm.

    The work folder and the ``--expose`` paths (the Python installation) stay
    reachable: a folder above them that the sandbox uid could not enter (say a
    Python under /root) is replaced by an empty one holding only them.
    """
    unshare(CLONE_NEWNET | CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    loopback_up()
    workdir = os.path.realpath(args.workdir)
    keeps = [workdir] + [os.path.realpath(p) for p in args.expose if os.path.isdir(p)]
    keep = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keeps}
    targets = {(os.path.realpath(p), True) for p in args.hide}
    targets |= {("/tmp", False), ("/dev/shm", False)}
    targets |= {(a, True) for a in map(_blocking_ancestor, keeps) if a}
    for target, read_only in sorted(targets, key=lambda t: (t[0].count("/"), t[0])):
        if target in keep or target == "/" or not os.path.lexists(target):
            continue  # never cover a kept path; a target inside a covered one is gone already
        _cover(target, keep, read_only=read_only, size="64k" if read_only else str(args.tmp_size))
    for fd in keep.values():
        os.close(fd)
    _loopback_names()
    try:  # other users' processes become invisible (best effort: needs a procfs we may mount)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        pass


#: variables a sandboxed process keeps from the grader's environment (names, or prefixes ending in _);
#: the rest (tokens, credentials, proxies) never reaches student code
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
            "PYTHONWARNINGS", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "MPLBACKEND", "NBGRADER_EXECUTION", "LC_", "JPY_", "DDP_COURSE_", "TORCH_",
            "NCCL_", "GLOO_", "CUDA_", "NVIDIA_")


def clean_environment(environ) -> dict[str, str]:
    """The part of ``environ`` a sandboxed process may see (see KEEP_ENV)."""
    return {k: v for k, v in environ.items()
            if k in KEEP_ENV or any(k.startswith(p) for p in KEEP_ENV if p.endswith("_"))}


def _limit(args) -> None:
    def setl(which, value):
        soft, hard = value, value
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            cur_soft, cur_hard = resource.getrlimit(which)
            if cur_hard != resource.RLIM_INFINITY and cur_hard < value:
                return  # already stricter
            resource.setrlimit(which, (min(soft, cur_hard), cur_hard))

    nproc = args.nproc
    if args.uid is None:  # RLIMIT_NPROC counts this user's processes everywhere: allow what already runs
        nproc += len(uid_processes(os.getuid()))
    setl(resource.RLIMIT_NPROC, nproc)
    resource.setrlimit(resource.RLIMIT_CPU, (args.cpu, args.cpu + 10))
    setl(resource.RLIMIT_FSIZE, args.fsize)
    setl(resource.RLIMIT_NOFILE, args.nofile)
    setl(resource.RLIMIT_CORE, 0)
    if args.address_space:
        setl(resource.RLIMIT_AS, args.address_space)


def _child(args, cmd: list[str]) -> None:  # pragma: no cover - runs in the forked child, ends in exec
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for path in args.cgroup:
            with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
        env = clean_environment(os.environ)
        for item in args.env:
            key, _, value = item.partition("=")
            env[key] = value
        env["PWD"] = args.workdir
        for key in ("HOME", "IPYTHONDIR", "MPLCONFIGDIR", "JUPYTER_RUNTIME_DIR"):
            if key in env:
                os.makedirs(env[key], exist_ok=True)
                if args.uid is not None:
                    os.chown(env[key], args.uid, args.uid)
        _limit(args)
        os.chdir(args.workdir)
        if args.uid is not None:
            os.setgroups([])
            os.setgid(args.uid)
            os.setuid(args.uid)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.execvpe(cmd[0], cmd, env)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox: cannot start {cmd[0]}: {exc}\n".encode())
        os._exit(127)


def _kill_rest(args, child: int) -> None:
    if args.uid is not None:
        kill_uid(args.uid, deadline=5)
    else:
        import psutil

        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass


def run(args, cmd: list[str]) -> int:
    """The wrapper: isolate (as root), fork the command as the sandbox uid, supervise it, clean up."""
    if args.isolate:
        try:
            _isolate(args)
        except OSError as exc:
            sys.stderr.write(f"sandbox: cannot isolate the submission ({exc}); refusing to run it\n")
            return 126
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the command come to us, so we can end them
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # jupyter interrupts the process group: that is the kernel's
    stop = {"at": None}

    def on_term(signum, frame):
        stop["at"] = stop["at"] or time.monotonic()
        try:
            os.kill(child, signal.SIGTERM)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    child = os.fork()
    if child == 0:  # pragma: no cover
        _child(args, cmd)
    code = 1
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            break
        if pid == 0:
            if os.getppid() != parent or (stop["at"] and time.monotonic() - stop["at"] > 3):
                break
            time.sleep(0.05)
    _kill_rest(args, child)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # reap what we killed
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.02)
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        sys.stderr.write("usage: python -m course.sandbox run --workdir W [options] -- CMD ...\n")
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m course.sandbox")
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("run")
    p.add_argument("--workdir", required=True)
    p.add_argument("--token", default="")
    p.add_argument("--isolate", action="store_true")
    p.add_argument("--uid", type=int, default=None)
    p.add_argument("--hide", action="append", default=[])
    p.add_argument("--expose", action="append", default=[])
    p.add_argument("--cgroup", action="append", default=[])
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--nproc", type=int, default=Limits.nproc)
    p.add_argument("--cpu", type=int, default=Limits.cpu_seconds)
    p.add_argument("--fsize", type=int, default=Limits.file_size)
    p.add_argument("--nofile", type=int, default=Limits.open_files)
    p.add_argument("--tmp-size", type=int, default=Limits.tmp_size)
    p.add_argument("--address-space", type=int, default=0)
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        parser.error("no command after --")
    if args.isolate and os.geteuid() != 0:
        parser.error("--isolate needs root")
    return run(args, cmd)


# --------------------------------------------------------------------------- the kernel manager


def __getattr__(name: str):
    # The kernel manager class is built on first use: importing jupyter_client costs ~0.8 s,
    # which the wrapper (this module run as a script) must not pay at every kernel start.
    if name == "SandboxKernelManager":
        cls = _kernel_manager_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kernel_manager_class():
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import Bool, Integer, List, Unicode

    class SandboxKernelManager(AsyncKernelManager):
        """A kernel manager whose kernel runs in a :class:`Sandbox` of its own work folder.

        Use as ``NotebookClient(kernel_manager_class=SandboxKernelManager)`` or in an
        nbgrader config ``c.Execute.kernel_manager_class = "course.sandbox.SandboxKernelManager"``.
        The work folder is the ``cwd`` the client starts the kernel in (nbclient and
        nbgrader pass the notebook's folder). ``hide`` adds paths to cover; with an
        nbgrader config, the course folder (and the one its source/ links to) is
        hidden too. Every process of the kernel is killed when the kernel shuts down.
        """

        hide = List(Unicode(), help="Paths the submission must not see (besides exercises/ and .git).").tag(config=True)
        memory_limit = Integer(Limits.memory, help="Bytes of memory for the whole sandbox.").tag(config=True)
        nproc_limit = Integer(Limits.nproc, help="Processes and threads of the sandbox.").tag(config=True)
        cpu_limit = Integer(Limits.cpu_seconds, help="CPU seconds per process.").tag(config=True)
        file_size_limit = Integer(Limits.file_size, help="Largest file a sandboxed process may write.").tag(config=True)
        snapshot_checks = Bool(True, help="Record what each check call receives, for course.verify.").tag(config=True)

        sandbox: Sandbox | None = None

        def limits(self) -> Limits:
            return Limits(memory=self.memory_limit, nproc=self.nproc_limit, cpu_seconds=self.cpu_limit,
                          file_size=self.file_size_limit)

        def hidden_paths(self) -> list[str]:
            return [*self.hide, *course_paths(self.config)]

        async def _async_pre_start_kernel(self, **kw):
            workdir = os.path.realpath(kw.get("cwd") or os.getcwd())
            if self.sandbox is None or self.sandbox.workdir != workdir:
                if self.sandbox is not None:
                    self.sandbox.close()
                self.sandbox = Sandbox(workdir, hide=self.hidden_paths(), limits=self.limits()).open()
            box = self.sandbox
            box.kill()  # a restart: nothing of the previous kernel survives
            kernel_dir = box.fresh_dir(KERNEL_DIR)
            self.transport = "ipc"  # unix sockets cross the network namespace; TCP would not
            self.connection_file = os.path.join(kernel_dir, "kernel.json")
            self.ip = os.path.join(kernel_dir, "ipc")
            if self.snapshot_checks:
                from course import snapshot

                snapshot.prepare(box)
            kw["cwd"] = workdir
            cmd, kw = await super()._async_pre_start_kernel(**kw)
            if box.uid is not None:
                os.chown(self.connection_file, box.uid, box.uid, follow_symlinks=False)
            self.log.info(box.summary)
            return box.command(cmd), kw

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            await super()._async_launch_kernel(kernel_cmd, **kw)
            pid = getattr(self.provisioner, "pid", None)
            if self.sandbox is not None and pid:
                self.sandbox.pids.append(pid)

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            try:
                await super()._async_cleanup_resources(restart=restart)
            finally:
                if self.sandbox is not None:
                    self.sandbox.kill() if restart else self.sandbox.close()

        def close_sandbox(self) -> None:
            """Kill everything left and give the work folder back (also when the kernel was never shut down)."""
            if self.sandbox is not None:
                self.sandbox.close()

    return SandboxKernelManager


def course_paths(config) -> list[str]:
    """The nbgrader course folder of a traitlets config, and the real course its source/ links to, if any."""
    try:
        root = config.CourseDirectory.root
    except AttributeError:
        return []
    if not isinstance(root, str) or not root:
        return []
    paths = [root]
    source = os.path.join(root, "source")
    if os.path.islink(source) or os.path.isdir(source):
        paths.append(os.path.dirname(os.path.realpath(source)))
    return paths


if __name__ == "__main__":
    sys.exit(main())
