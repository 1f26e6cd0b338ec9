"""Run a submission's code (its kernel, its ranks, the grader's re-run of its checks) in a sandbox.

The grader side is :class:`Sandbox`: for one submission it takes a dedicated
unprivileged uid (no passwd entry), a memory/pids cgroup and the work folder
(a fresh folder holding only the submission's files), wraps command lines in
``python -m course.sandbox run ... -- CMD`` and, when grading ends, kills
everything the sandbox started (one kill(-1) as the uid, the cgroup, the
supervisors) and gives the folder back.

The wrapper (:mod:`course.sandbox.wrapper`), as root, runs ``CMD`` in a new network
namespace (loopback only: ranks still rendezvous on 127.0.0.1) and a private
mount namespace where the exercises' sources, the nbgrader course folder and
.git are covered by empty read-only tmpfs mounts, /tmp and /dev/shm are
private; then rlimits, the cgroup, no new privileges, the sandbox uid, exec.
Where namespaces are not allowed (a container without CAP_SYS_ADMIN) it still
switches uid; not root (an instructor's laptop) it can only apply rlimits and
the work folder. :attr:`Sandbox.summary` says which ("sandbox: full" or
"sandbox: partial, <why>: ..."), for grading to report once.

The Jupyter kernel manager that starts a kernel in a Sandbox is grading's
(:mod:`course.grading.kernel`); a kernel talks to its client over unix sockets
(ZMQ ``ipc``), which cross the network namespace, in a short per-sandbox folder
(:attr:`Sandbox.runtime_dir`).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from course.envnames import GRADING_ENV, TOKEN_ENV
from course.paths import CHECKOUT
from course.proc import kill_tree
from course.sandbox import landlock
from course.sandbox.limits import GiB, Limits
from course.sandbox.linux import (
    Cgroups,
    blocking_ancestor,
    is_under,
    kill_uid,
    marked_processes,
    namespaces_available,
    rootless_available,
    uid_processes,
)

#: uids handed to sandboxes (no passwd entry); one per concurrently graded submission
UID_RANGE = range(61000, 61512)
#: "FIRST-LAST", a part of UID_RANGE for this grader's sandboxes (two graders on one machine that must tell
#: their sandboxes' processes apart, as the test suite's workers do); unset: all of UID_RANGE
UIDS_ENV = "DDP_COURSE_SANDBOX_UIDS"
#: folders inside the work folder that the sandbox machinery owns
KERNEL_DIR = ".kernel"
HOME_DIR = ".home"

_FORCE_PARTIAL_ENV = "DDP_COURSE_SANDBOX_PARTIAL"  # tests: behave as when not root


# --------------------------------------------------------------------------- the grader side


def _lock_dir() -> Path:
    """Root's folder for uid locks and kernel sockets: short paths (a unix socket path has at most 107
    bytes), outside /tmp and /dev/shm (private in a sandbox), enterable but not listable by others."""
    for candidate in (Path("/run/ddp-course-sandbox"), Path("/var/tmp/ddp-course-sandbox"),
                      Path(tempfile.gettempdir()) / "ddp-course-sandbox-locks"):
        try:
            candidate.mkdir(mode=0o711, parents=True, exist_ok=True)
            os.chmod(candidate, 0o711)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no folder for the sandbox uid locks")


def uid_range() -> range:
    """The uids this grader's sandboxes take: UID_RANGE, or the part of it that UIDS_ENV names."""
    spec = os.environ.get(UIDS_ENV, "").strip()
    if not spec:
        return UID_RANGE
    first, _, last = spec.partition("-")
    try:
        uids = range(int(first), int(last) + 1)
    except ValueError:
        uids = range(0)
    if not uids or uids.start < UID_RANGE.start or uids.stop > UID_RANGE.stop:
        raise ValueError(f"{UIDS_ENV}={spec!r}: give FIRST-LAST within {UID_RANGE.start}-{UID_RANGE.stop - 1}")
    return uids


def _free_uid() -> tuple[int, int]:
    """(uid, fd of its lock): a uid of :func:`uid_range` with no passwd entry that no other sandbox holds."""
    folder = _lock_dir()
    uids = uid_range()
    for uid in uids:
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
        # leftovers of a grader that died; unreaped zombies of the last sandbox still count against
        # RLIMIT_NPROC for this uid (a fork bomb leaves hundreds for a moment): take another uid then
        if not kill_uid(uid) or uid_processes(uid, zombies=True):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            continue
        return uid, fd
    raise RuntimeError(f"all {len(uids)} sandbox uids ({uids.start}-{uids.stop - 1}) are in use")


def default_hidden() -> list[str]:
    """What a submission never sees, whatever the course: this checkout's exercise sources, its tests (whole
    right answers in other styles, the wrong ones, test exercises with their solutions) and .git."""
    return [str(CHECKOUT / name) for name in ("exercises", "tests", ".git") if (CHECKOUT / name).exists()]


def python_paths() -> list[str]:
    """What sandboxed Python needs to reach: the interpreter, its libraries, this package's checkout."""
    import site
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             str(CHECKOUT)}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:
        pass
    # PYTHONPATH reaches the sandboxed Python too (KEEP_ENV): its folders must be there, also under /tmp
    paths.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p))
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def python_flags() -> list[str]:
    """Flags for a trusted Python started in a submission's folder: never import from the current
    folder or from the user's site-packages (both are the submission's to write)."""
    return ["-s", "-P"] if sys.version_info >= (3, 11) else ["-I"]


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
        forced = os.environ.get(_FORCE_PARTIAL_ENV) == "1"
        if isolate is None:
            isolate = not forced
        root = os.geteuid() == 0
        probe = namespaces_available if root else rootless_available
        ok, why = probe() if isolate else (False, f"{_FORCE_PARTIAL_ENV}=1" if forced else "asked to")
        #: new network and mount namespaces (root, where the OS allows them; without root, in a user namespace)
        self.isolated = ok
        #: isolated without root: user, network, mount and pid namespaces, the submission as this user
        self.rootless = ok and not root
        if self.rootless:  # this user's own files (keys, tokens, other courses): the submission runs as this user
            self.hide += [p for p in _homes() if p not in self.hide]
        #: a dedicated uid (root): with namespaces, or without them if Python is reachable by another user
        self.switch_uid = os.geteuid() == 0 and not forced and (ok or not any(map(blocking_ancestor, python_paths())))
        self.why_partial = why
        #: not isolated, but Landlock here: the submission reads all but the hidden folders and writes only its own
        self.confined = not ok and landlock.abi() > 0
        self._summary = ""
        #: a short folder for the kernel's unix sockets and connection file (see _lock_dir)
        self.runtime_dir = ""

    # -- lifecycle

    def open(self) -> Sandbox:
        if self.opened:
            return self
        os.makedirs(self.workdir, exist_ok=True)
        st = os.stat(self.workdir)
        self._owner = (st.st_uid, st.st_gid)
        if self.switch_uid:
            self.uid, self._lock_fd = _free_uid()
            # a name of its own: the last cgroup of this uid may still be there, holding zombies
            self.cgroups = Cgroups.create(f"ddp-sandbox-{self.uid}-{self.token[:8]}", self.limits)
            _chown_tree(self.workdir, self.uid, self.uid, only_from=None)
            os.chmod(self.workdir, 0o700)
            self.runtime_dir = str(_lock_dir() / f"k{self.uid}")
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            os.mkdir(self.runtime_dir, 0o700)
            os.chown(self.runtime_dir, self.uid, self.uid)
        else:
            self.runtime_dir = tempfile.mkdtemp(prefix="ddpk-")
        self.opened = True
        self._summary = self._describe()
        return self

    def __enter__(self) -> Sandbox:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def kill(self) -> None:
        """SIGKILL every process the sandbox started (bounded: a few seconds at most)."""
        if self.uid is not None:
            kill_uid(self.uid, deadline=30)  # first: one kill(-1) as the uid stops even a fork bomb at once
            self.cgroups.kill()
        if self.rootless:  # the supervisors' children are pid 1 of their namespaces: the kernel ends the rest
            _kill_children(self.pids)
        for pid in self.pids:  # the supervisors (root when isolated) and anything they still hold
            kill_tree(pid)
        self.pids = []
        if self.uid is None:
            for _ in range(3):
                strays = marked_processes(self.token)
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
            if self.runtime_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
                self.runtime_dir = ""
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
        return self._summary or self._describe()

    def _describe(self) -> str:
        memory = self.cgroups.memory or f"RLIMIT_AS {self.limits.address_space / GiB:g} GiB per process" + (
            ", so GPUs hidden" if os.path.exists("/dev/nvidiactl") else "")
        if self.rootless:
            return (f"sandbox: rootless (user namespace: runs as this user without capabilities, no network, "
                    f"sources, course files and home folders hidden, private /tmp, its own processes only; {memory}, "
                    f"at most {self.limits.nproc} more processes of this user)")
        if self.isolated:
            return (f"sandbox: full (uid {self.uid}, no network, sources and course files hidden, "
                    f"{memory}, at most {self.limits.nproc} processes)")
        if self.confined:
            who = f"uid {self.uid}" if self.switch_uid else "this user"
            return (f"sandbox: partial, {self.why_partial}: the submission runs as {who} with rlimits ({memory}), "
                    "confined by Landlock to writing its own folder and reading all but the sources, course files, "
                    "home folders and /tmp; it can use the network")
        if self.switch_uid:
            return (f"sandbox: partial, {self.why_partial}: the submission runs as uid {self.uid} ({memory}, at most "
                    f"{self.limits.nproc} processes) but can use the network and read world-readable files "
                    "(exercise sources included)")
        return (f"sandbox: partial, {self.why_partial}: the submission runs as this user with rlimits ({memory}) in "
                "its own folder, but can read this user's files (exercise sources included) and use the network")

    def env(self) -> dict[str, str]:
        """Environment variables every sandboxed process gets (its home and caches inside the work folder)."""
        home = os.path.join(self.workdir, HOME_DIR)
        return {
            "HOME": home,
            "IPYTHONDIR": os.path.join(home, ".ipython"),
            "MPLCONFIGDIR": os.path.join(home, ".matplotlib"),
            "JUPYTER_RUNTIME_DIR": self.runtime_dir or os.path.join(self.workdir, KERNEL_DIR),
            "JUPYTER_DATA_DIR": os.path.join(home, ".jupyter-data"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(home, ".inductor"),
            "XDG_CACHE_HOME": os.path.join(home, ".cache"),
            TOKEN_ENV: self.token,
            GRADING_ENV: "1",  # course.warm_up() starts nothing: no check runs in a graded kernel
            # confined, /tmp is out of reach: the short per-sandbox folder holds the temporary files (and sockets)
            **({"TMPDIR": self.runtime_dir} if self.confined and self.runtime_dir else {}),
            # CUDA cannot start under an address-space limit (it reserves far more than it uses): without a
            # cgroup, GPUs are hidden, so torch runs on the CPU instead of warning on every cell's stderr
            **({} if self.cgroups.paths else {"CUDA_VISIBLE_DEVICES": ""}),
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

    def command(self, argv: list[str], workdir: str | None = None, relay_output: bool = False) -> list[str]:
        """``argv`` wrapped so that it runs inside this sandbox.

        ``relay_output``: the command's stdout and stderr are copied to the wrapper's
        stderr up to 256 kB, then dropped (for a kernel, whose cell outputs travel
        as messages, not on these streams).
        """
        if not self.opened:
            self.open()
        lim = self.limits
        cmd = [sys.executable, *python_flags(), "-m", "course.sandbox", "run",
               "--workdir", workdir or self.workdir, "--token", self.token,
               "--nproc", str(lim.nproc), "--cpu", str(lim.cpu_seconds), "--fsize", str(lim.file_size),
               "--nofile", str(lim.open_files), "--tmp-size", str(lim.tmp_size)]
        if self.uid is not None:
            cmd += ["--uid", str(self.uid)]
        if self.isolated:
            cmd += ["--isolate", *(["--rootless"] if self.rootless else [])]
            for path in self.hide:
                cmd += ["--hide", path]
            for path in [*python_paths(), self.runtime_dir]:
                if not any(is_under(path, hidden) for hidden in self.hide):  # a PYTHONPATH into exercises/
                    cmd += ["--expose", path]
            for path in self.cgroups.paths:
                cmd += ["--cgroup", path]
        elif self.confined:
            cmd += ["--confine", "--writable", self.runtime_dir]
            for path in [*self.hide, *(p for p in _homes() if p not in self.hide)]:
                cmd += ["--hide", path]
            for path in [*python_paths(), self.runtime_dir]:
                if not any(is_under(path, hidden) for hidden in self.hide):
                    cmd += ["--expose", path]
        if not self.cgroups.paths:
            cmd += ["--address-space", str(lim.address_space)]
        if relay_output:
            cmd.append("--relay-output")
        for key, value in self.env().items():
            cmd += ["--env", f"{key}={value}"]
        return [*cmd, "--", *argv]


def _kill_children(pids: list[int]) -> None:
    """SIGKILL the direct children of ``pids`` (no walk of the whole tree: a fork bomb makes that take seconds)."""
    import psutil

    for pid in pids:
        try:
            children = psutil.Process(pid).children()
        except psutil.Error:
            continue
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass


def _homes() -> list[str]:
    """The home folders a rootless sandbox covers: this user's, and /home (everyone's)."""
    found = [os.path.realpath(os.path.expanduser("~")), "/home"]
    return [p for p in dict.fromkeys(found) if p != "/" and os.path.isdir(p)]


def describe() -> str:
    """What a sandbox gives on this machine, in one line, without starting one (for a run's header)."""
    box = Sandbox(tempfile.gettempdir())
    if box.rootless:
        return box._describe()
    if box.isolated:
        return "sandbox: full (a uid per submission, no network, sources and course files hidden, memory and process limits)"
    return box._describe().replace("uid None", "a uid of its own")


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
