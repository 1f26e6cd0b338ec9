"""The sandbox wrapper: ``python -m course.sandbox run --workdir W [options] -- CMD ...``.

Run by the grader in front of a submission's process. As root (full isolation):
new network and mount namespaces (:func:`_isolate`), rlimits, the cgroup, then
``CMD`` as the sandbox uid with no new privileges. Without root (``--rootless``):
new user, network, mount and pid namespaces instead (the same mounts; the
submission runs as the grader's own user, with no capabilities, and sees and
signals only its own processes; :func:`_namespace_init` is pid 1 there). The
wrapper stays as a supervisor: a child subreaper that reaps orphans, copies a
capped amount of ``CMD``'s own output, and kills everything left when ``CMD``
ends or when the grader disappears.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import time

from course.proc import PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, prctl
from course.sandbox.landlock import confine, readable_except
from course.sandbox.limits import Limits
from course.sandbox.linux import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    blocking_ancestor,
    enter_user_namespace,
    is_under,
    kill_uid,
    loopback_up,
    mount,
    uid_processes,
    unshare,
)


def _cover(target: str, keep: dict[str, int], *, read_only: bool, size: str) -> None:
    """Mount an empty tmpfs over ``target`` (a file: /dev/null), then bind back the ``keep`` paths inside it.

    ``keep`` maps paths to O_PATH descriptors opened before anything was covered.
    """
    if os.path.isdir(target) and not os.path.islink(target):
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={'0755' if read_only else '1777'}")
        for path, fd in sorted(keep.items()):
            if is_under(path, target) and path != target:
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        if read_only:
            mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
    elif os.path.exists(target):
        mount("/dev/null", target, None, MS_BIND)
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


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
    if args.rootless:  # the pid namespace takes effect for the next fork: _namespace_init, its pid 1
        enter_user_namespace(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID)
    else:
        unshare(CLONE_NEWNET | CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    loopback_up()
    workdir = os.path.realpath(args.workdir)
    keeps = [workdir] + [os.path.realpath(p) for p in args.expose if os.path.isdir(p)]
    keep = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keeps}
    targets = {(os.path.realpath(p), True) for p in args.hide}
    targets |= {("/tmp", False), ("/dev/shm", False)}
    targets |= {(a, True) for a in map(blocking_ancestor, keeps) if a}
    for target, read_only in sorted(targets, key=lambda t: (t[0].count("/"), t[0])):
        if target in keep or target == "/" or not os.path.lexists(target):
            continue  # never cover a kept path; a target inside a covered one is gone already
        _cover(target, keep, read_only=read_only, size="64k" if read_only else str(args.tmp_size))
    for fd in keep.values():
        os.close(fd)
    _loopback_names()
    if args.rootless:
        return  # /proc: a fresh one for the new pid namespace, mounted by its pid 1 (_namespace_init)
    try:  # other users' processes become invisible (best effort: needs a procfs we may mount)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        pass


def _namespace_init(args, cmd: list[str]) -> None:  # pragma: no cover - runs in the forked child, ends in _exit
    """pid 1 of a rootless sandbox's pid namespace: mount its /proc, start ``CMD``, reap, pass SIGTERM on.

    When it exits, the kernel kills every process left in the namespace: nothing the submission
    started can outlive it, and nothing outside the namespace can be seen or signalled from inside."""
    try:  # the outer /proc would list this user's other processes, their environment and files readable
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        os.write(2, f"sandbox: cannot mount /proc for the pid namespace ({exc}); refusing to run it\n".encode())
        os._exit(126)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupts reach CMD itself (its process group)
    command = os.fork()
    if command == 0:
        _child(args, cmd)

    def forward(signum, frame):
        try:
            os.kill(command, signum)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    code = 1
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == command:
            code = os.waitstatus_to_exitcode(status)
            break
    os._exit(code if code >= 0 else 128 - code)


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
        nproc += args.own_processes
    setl(resource.RLIMIT_NPROC, nproc)
    resource.setrlimit(resource.RLIMIT_CPU, (args.cpu, args.cpu + 10))
    setl(resource.RLIMIT_FSIZE, args.fsize)
    setl(resource.RLIMIT_NOFILE, args.nofile)
    setl(resource.RLIMIT_CORE, 0)
    if args.address_space:
        setl(resource.RLIMIT_AS, args.address_space)


def _exec(cmd: list[str], env: dict) -> None:
    os.execvpe(cmd[0], cmd, env)


#: how the sandboxed command is started once everything is in place (see :func:`configure`)
_exec_hook = _exec


def configure(*, exec_hook=None) -> None:
    """How this process starts the command it sandboxes, once everything is in place: ``exec_hook(cmd, env)``,
    which never returns (default: exec it; a zygote, :mod:`course.sandbox.zygote`, runs a module of its own
    Python in place instead)."""
    global _exec_hook
    _exec_hook = exec_hook or _exec


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
        if args.rootless:  # ipykernel exits when its parent is not that pid: in here every pid is another one
            env.pop("JPY_PARENT_PID", None)  # (the wrapper ends the namespace if the grader goes away)
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
        if args.confine:  # no namespaces here: the kernel's Landlock keeps the files out of reach instead
            _confine(args)
        _exec_hook(cmd, env)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox: cannot start {cmd[0]}: {exc}\n".encode())
        os._exit(127)


#: device files a submission's process writes (its output, random numbers); /dev/shm: ranks share tensors there
_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/pts", "/dev/shm"]


def _confine(args) -> None:
    """Without namespaces (``--confine``): everything readable but the ``--hide`` paths, /tmp and /var/tmp (the
    ``--expose`` paths, the Python installation, stay readable); writable only the work folder, the
    ``--writable`` ones and the devices a process writes (:mod:`course.sandbox.landlock`). Nothing where the
    kernel has no Landlock: the grader's summary says so."""
    denied = [os.path.realpath(p) for p in [*args.hide, "/tmp", "/var/tmp"]]
    readable = readable_except(denied)
    for path in map(os.path.realpath, args.expose):  # readable even under a denied folder, but not what it hides
        readable += readable_except([d for d in denied if is_under(d, path) and d != path], root=path)
    confine(readable, [args.workdir, *args.writable, *_DEVICES])


def _kill_rest(args, child: int) -> None:
    if args.rootless:  # pid 1 of the namespace: the kernel kills everything in it with it
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    elif args.uid is not None:
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


class _Relay:
    """Copies the sandboxed command's stdout/stderr to ours, up to RELAY_LIMIT bytes; drops the rest."""

    RELAY_LIMIT = 256 << 10

    def __init__(self, fd: int):
        self.fd, self.sent, self.open = fd, 0, True
        os.set_blocking(fd, False)

    def pump(self, wait: float) -> None:
        import select

        if not self.open:
            time.sleep(wait)
            return
        ready, _, _ = select.select([self.fd], [], [], wait)
        while ready:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.open = False
                os.close(self.fd)
                return
            if self.sent < self.RELAY_LIMIT:
                chunk = data[: self.RELAY_LIMIT - self.sent]
                self.sent += len(data)
                _write_all(2, chunk)
                if self.sent >= self.RELAY_LIMIT:
                    _write_all(2, b"\n[sandbox: more output of the sandboxed process was dropped]\n")
            else:
                self.sent += len(data)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def run(args, cmd: list[str]) -> int:
    """The wrapper: isolate, fork the command (as the sandbox uid when root), supervise it, clean up."""
    # counted before isolating: a rootless sandbox's /proc shows only its own processes
    args.own_processes = len(uid_processes(os.getuid())) if args.uid is None else 0
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
    # --relay-output: the command's own stdout/stderr (a kernel's: not the cells' outputs) reach ours capped
    read_end, write_end = os.pipe() if args.relay_output else (None, None)
    child = os.fork()
    if child == 0:  # pragma: no cover
        if write_end is not None:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.close(write_end)
        _namespace_init(args, cmd) if args.rootless else _child(args, cmd)
    relay = None
    if write_end is not None:
        os.close(write_end)
        relay = _Relay(read_end)
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
            relay.pump(0.05) if relay else time.sleep(0.05)
    if relay:
        relay.pump(0)
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
    p.add_argument("--rootless", action="store_true", help="with --isolate, without root: a user namespace")
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
    p.add_argument("--relay-output", action="store_true")
    p.add_argument("--confine", action="store_true", help="without --isolate: Landlock keeps --hide out of reach")
    p.add_argument("--writable", action="append", default=[])
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        parser.error("no command after --")
    if args.isolate and os.geteuid() != 0 and not args.rootless:
        parser.error("--isolate needs root (or --rootless)")
    if args.rootless and (os.geteuid() == 0 or not args.isolate or args.uid is not None):
        parser.error("--rootless is --isolate for a non-root user, without --uid")
    return run(args, cmd)


