"""A warm zygote: starts a submission's sandboxed processes by fork, with torch and the rest already imported.

Each graded submission starts a kernel and a verifier, each a fresh Python that imports torch (and the verifier
torch._dynamo, for the ranks' forkserver): about 5 of the 8.7 CPU seconds a graded ex1 submission cost. An
autograde worker grades one submission after another, so it keeps one zygote (:class:`Zygote`): a Python started
once per worker, as the worker's own user, that imports all of that once (the ``preload`` it is given) and then
only forks; ``ddp-course grade`` and ``check`` start one on demand (:func:`on_demand`) for their two processes.
Nothing of a submission ever runs in it.

``zygote.popen(argv, env=..., cwd=...)`` is ``subprocess.Popen(argv, env=..., cwd=..., start_new_session=True)``,
only faster: the zygote forks, the child takes the caller's stdin/stdout/stderr and becomes ``argv``. When
``argv`` runs a module of this Python (``sys.executable [-s] [-P] -m MODULE ...``, the sandbox wrapper included,
then the kernel or the verifier it starts) the child runs the module in place, as a fresh interpreter would
(:func:`_run_module`); anything else, or a module whose environment differs from the zygote's in what is read at
import time (:data:`IMPORT_TIME_ENV`), is really exec'd. The sandbox is the same either way: the wrapper's
namespaces, mounts, rlimits, cgroup, uid and no-new-privileges are applied in the child before the submission's
code runs, exactly as before its exec (:mod:`course.sandbox.wrapper`).

What a forked process shares with its zygote and a fresh one would not: the modules already imported (their
code and state as imported, never touched by a submission), the hash seed (Python's; re-seeded: ``random``,
numpy's global generator, multiprocessing's authkey). What it does not get: the zygote's descriptors (all
closed but the three it is given) and anything of another submission (the zygote holds none).

The caller talks to the zygote over a socketpair (requests, with the descriptors attached); each child's pid
and, when the zygote reaps it, its exit status come back on a socket of its own, which :class:`ZygoteProcess` (a
``Popen`` look-alike: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate``) reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

#: what every zygote imports once (each process it forks runs the wrapper first); its user adds what its
#: processes import (grading: :data:`course.grading.kernel.ZYGOTE_PRELOAD`)
PRELOAD = ("course.sandbox.wrapper",)
#: environment variables read while PRELOAD is imported: a process whose value differs is exec'd instead
IMPORT_TIME_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH_", "TORCHDYNAMO_")
#: the zygote's own interpreter flags; a module run with a subset of them can be forked
_FLAGS = ("-s", "-P") if sys.version_info >= (3, 11) else ("-I",)
_REQUEST_LIMIT = 1 << 20
_EXTRA_FDS = 8  # the most descriptors a request passes on (Zygote.popen's pass_fds)
_UNBUFFERED = bool(os.environ.get("PYTHONUNBUFFERED"))  # as Python read it at this process's start (-u's effect)
_ENV = "DDP_COURSE_ZYGOTE"  # "0": never use a zygote (every process is exec'd, as without one)
#: in a process a reporting zygote forked: a number drawn for it alone (os.urandom, in the zygote, before the
#: fork) that the zygote also told the reader of its reports; None in every other process. Its uses: data that
#: only this process and the launcher can know (what a student's process cannot compute for another one)
SECRET: int | None = None


def _import_time_env(env) -> dict[str, str]:
    """What of ``env`` a sandboxed process keeps and its preloaded modules read at import."""
    from course.sandbox.wrapper import clean_environment

    return {k: v for k, v in clean_environment(env).items() if k.startswith(IMPORT_TIME_ENV)}


# --------------------------------------------------------------------------- the caller's side


class ZygoteProcess:
    """A process the zygote forked, seen like a ``subprocess.Popen``."""

    def __init__(self, pid: int, status: socket.socket, stdin=None, stdout=None, stderr=None):
        self.pid, self.returncode, self.args = pid, None, None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._status = status

    def _read_status(self, timeout: float | None) -> None:
        if self.returncode is not None or self._status is None:
            return
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        data = self._status.recv(4096)
        try:
            self.returncode = int(json.loads(data)["exit"]) if data else -signal.SIGKILL
        except (ValueError, KeyError, TypeError):
            self.returncode = -signal.SIGKILL  # the zygote died before it could say: the process is gone with it
        self._status.close()
        self._status = None

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args or "zygote process", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Popen.communicate for pipes opened by :meth:`Zygote.popen`: write ``input``, read both streams
        to their end; raises ``subprocess.TimeoutExpired`` at ``timeout`` (call again to read the rest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not hasattr(self, "_pending"):
            self._pending = memoryview(input or b"")
            self._out, self._err = [], []
            if self.stdin is not None and not self._pending:
                self.stdin.close()
        streams = {s.fileno(): (s, buf) for s, buf in ((self.stdout, self._out), (self.stderr, self._err))
                   if s is not None and not s.closed}
        while streams or (self.stdin is not None and not self.stdin.closed):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args or "zygote process", timeout)
            writers = [self.stdin] if self.stdin is not None and not self.stdin.closed else []
            readable, writable, _ = select.select(list(streams), writers, [], left)
            if writable:
                try:
                    sent = os.write(self.stdin.fileno(), self._pending[:1 << 16])
                except BrokenPipeError:
                    sent = len(self._pending)
                self._pending = self._pending[sent:]
                if not self._pending:
                    self.stdin.close()
            for fd in readable:
                stream, buf = streams[fd]
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    buf.append(chunk)
                else:
                    stream.close()
                    del streams[fd]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 5)
        return b"".join(self._out), b"".join(self._err)


class Zygote:
    """One zygote process (see the module's text); ``popen`` forks a process from it."""

    def __init__(self, preload=PRELOAD, report_fd: int | None = None, fork: bool = False, env: dict | None = None):
        """``report_fd``: a descriptor (a pipe's end) on which the zygote says ``Z ITS-PID`` once, then
        ``PID RANK SECRET`` for each process it forks (RANK from the environment it was given, ``-`` for none;
        SECRET the number it drew for that process, which finds it as :data:`SECRET`); the zygote then makes
        itself undumpable (no process of its uid may trace it or read its descriptors).

        ``fork``: start the zygote by forking this process instead of a fresh Python, where that gives the same
        zygote (:func:`_forkable`): this process has imported all of ``preload`` already, runs with the zygote's
        flags and no code but ours has run in it (torchrun's agent, which imports torch anyway: one import of
        torch instead of two). ``env``: the environment of a zygote that is exec'd (default: this process's);
        what it imports with decides which processes it can run in place (:data:`IMPORT_TIME_ENV`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.preload = tuple(preload)
        if fork and _forkable(self.preload):
            self._proc = _fork_zygote(ours, theirs, self.preload, report_fd)
        else:
            fds, extra = [theirs.fileno()], []
            if report_fd is not None:
                fds.append(report_fd)
                extra = [str(report_fd)]
            self._proc = subprocess.Popen(  # the flags of box.python_flags(): nothing imported from where it starts
                [sys.executable, *_FLAGS, "-m", "course.sandbox.zygote", str(theirs.fileno()), ",".join(preload),
                 *extra], pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=False, env=env)
        theirs.close()
        self._sock = ours
        self.pid = self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def popen(self, argv: list[str], *, env: dict | None = None, cwd: str | None = None,
              stdin=None, stdout=None, stderr=None, pass_fds=(), deathsig: int | None = None) -> ZygoteProcess:
        """``subprocess.Popen(argv, env, cwd, stdin, stdout, stderr, pass_fds, start_new_session=True)``, forked
        from the zygote. Streams: None (ours), ``subprocess.PIPE``, ``subprocess.DEVNULL``, a descriptor or a
        file; ``pass_fds``: descriptors of ours the process holds under the same numbers (3 and up).
        ``deathsig``: the signal the process gets when the zygote ends (``PR_SET_PDEATHSIG``; a zygote ends
        when its caller is gone), so that it does not outlive its caller."""
        pass_fds = [int(fd) for fd in pass_fds]
        if any(fd < 3 for fd in pass_fds) or len(pass_fds) > _EXTRA_FDS:
            raise ValueError(f"pass_fds: at most {_EXTRA_FDS} descriptors, each 3 or more, not {pass_fds}")
        mine, child_ends, keep = {}, [], []
        for index, spec in enumerate((stdin, stdout, stderr)):
            if spec is subprocess.PIPE:
                r, w = os.pipe()
                ours, theirs = (w, r) if index == 0 else (r, w)
                mine[index] = os.fdopen(ours, "wb" if index == 0 else "rb", buffering=0)
                child_ends.append(theirs)
                keep.append(theirs)
            elif spec is subprocess.DEVNULL or (spec is None and index == 0):
                fd = os.open(os.devnull, os.O_RDWR)
                child_ends.append(fd)
                keep.append(fd)
            elif spec is None:
                child_ends.append(index)
            else:
                child_ends.append(spec if isinstance(spec, int) else spec.fileno())
        status_ours, status_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ if env is None else env)
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": os.fspath(cwd) if cwd else os.getcwd(),
                   "fds_at": pass_fds, "deathsig": deathsig}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()],
                            [*child_ends, status_theirs.fileno(), *pass_fds])
        finally:
            status_theirs.close()
            for fd in keep:
                os.close(fd)
        ready, _, _ = select.select([status_ours], [], [], 30)
        reply = status_ours.recv(4096) if ready else b""
        try:
            pid = int(json.loads(reply)["pid"])
        except (ValueError, KeyError, TypeError):
            status_ours.close()
            for stream in mine.values():
                stream.close()
            raise OSError(f"the zygote did not start {argv[0]}: {reply.decode(errors='replace') or 'no answer'}") from None
        proc = ZygoteProcess(pid, status_ours, mine.get(0), mine.get(1), mine.get(2))
        proc.args = argv
        return proc

    def close(self) -> None:
        """Stop the zygote (what it started goes on: each is its caller's to end)."""
        try:
            self._sock.close()
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _forkable(preload: tuple[str, ...]) -> bool:
    """Whether a zygote forked from this process is the one a fresh Python would make: every module of
    ``preload`` imported here, and this Python started with the zygote's flags (nothing imported from the folder
    it started in, no user site)."""
    flags = (sys.flags.safe_path and sys.flags.no_user_site) if sys.version_info >= (3, 11) else sys.flags.isolated
    return bool(flags) and all(name in sys.modules for name in preload)


class _Forked:
    """The zygote forked from this process, seen as the ``Popen`` of an exec'd one (what :class:`Zygote` uses)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["zygote"], timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _fork_zygote(ours: socket.socket, theirs: socket.socket, preload: tuple[str, ...], report_fd: int | None) -> _Forked:
    """Fork this process into a zygote serving on ``theirs`` (its stdin /dev/null, its other descriptors closed
    but its stdout, stderr, ``theirs`` and ``report_fd``: what an exec'd zygote is given)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the zygote; ends in os._exit
        code = 1
        try:
            _name("zygote")  # first: until then it is its caller's copy, by name too (a launcher's walk reads names)
            from course.proc import close_descriptors_except

            ours.close()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            close_descriptors_except({0, 1, 2, theirs.fileno(), *([report_fd] if report_fd is not None else [])})
            code = serve(theirs.fileno(), list(preload), report_fd)
        except BaseException as exc:  # noqa: BLE001 - said on our stderr, as an exec'd zygote's would be
            os.write(2, f"zygote: {exc!r}\n".encode())
        finally:
            os._exit(code)
    return _Forked(pid)


#: the zygote this process's sandboxes use (set by an autograde worker), or None: every process is exec'd;
#: ``_on_demand``: the preload of one to start when a process is first asked of it (:func:`on_demand`)
_current: Zygote | None = None
_on_demand: tuple[str, ...] | None = None
_starting = threading.Lock()


def current() -> Zygote | None:
    """This process's zygote (started now if one is due on demand, restarted if it died); None where none is."""
    global _current, _on_demand
    with _starting:  # threads that ask at once (a caller grading notebooks side by side) start one zygote
        if _current is None and _on_demand is not None:
            _current, _on_demand = Zygote(_on_demand), None
        if _current is not None and not _current.alive():
            _current = Zygote(_current.preload)
        return _current


@contextlib.contextmanager
def on_demand(preload):
    """Within it, this process's zygote imports ``preload``, started with the first process asked of it (a command
    that fails before pays nothing), stopped at the end; nothing where zygotes are off or one is in use."""
    global _current, _on_demand
    if enabled() and _current is None and _on_demand is None:
        _on_demand = tuple(preload)
        try:
            yield
        finally:
            started, _current, _on_demand = _current, None, None
            if started is not None:
                started.close()
    else:
        yield


def use(zygote: Zygote | None) -> None:
    """Make ``zygote`` this process's (None: none)."""
    global _current
    _current = zygote


def enabled() -> bool:
    """Whether zygotes may be used here (``DDP_COURSE_ZYGOTE=0`` turns them off)."""
    return os.environ.get(_ENV, "1") != "0"


def popen(argv: list[str], **kwargs):
    """``Zygote.popen`` with this process's zygote, else ``subprocess.Popen(..., start_new_session=True)``."""
    zygote = current()
    if zygote is not None:
        return zygote.popen(argv, **kwargs)
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


# --------------------------------------------------------------------------- the zygote


def _module_of(argv: list[str]) -> tuple[str, list[str], bool] | None:
    """(module, its arguments, whether ``-P`` was given) when ``argv`` runs a module of this Python with
    flags the zygote has; None otherwise (it must be exec'd)."""
    if not argv or argv[0] != sys.executable:
        return None
    rest = argv[1:]
    flags = []
    # -u where this zygote's streams are unbuffered already (PYTHONUNBUFFERED, which a forked child's env matches)
    known = (*_FLAGS, "-u") if _UNBUFFERED else _FLAGS
    while rest and rest[0] in known:
        flags.append(rest.pop(0))
    if len(rest) < 2 or rest[0] != "-m" or not rest[1] or rest[1].startswith("-"):
        return None
    return rest[1], rest[2:], "-P" in flags or "-I" in flags


def _runnable(argv: list[str], env: dict):
    """``_module_of(argv)`` when this zygote can run it in place with ``env``, else None."""
    module = _module_of(argv)
    return module if module is not None and _import_time_env(env) == _ZYGOTE_ENV else None


def exec_or_run(argv: list[str], env: dict) -> None:
    """Become ``argv`` with ``env``: run it in place when it is a module this zygote can run, else exec it.

    Never returns. The sandbox wrapper calls it (``wrapper.configure(exec_hook=...)``) for the command it sandboxes."""
    module = _runnable(argv, env)
    if module is None:
        os.execvpe(argv[0], argv, env)
    _run_module(*module, env)


def _run_module(module: str, args: list[str], safe_path: bool, env: dict) -> None:  # pragma: no cover - ends in _exit
    """``python -m module args`` in this (forked) process, as a fresh interpreter would run it."""
    import atexit
    import multiprocessing
    import random
    import runpy
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # from this environment, not the zygote's: found now, as a fresh interpreter's
    tempfile.gettempdir()  # imports do (torch's), before the module runs (finding it writes a probe file there)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    multiprocessing.current_process().authkey = os.urandom(32)
    from course.proc import PR_SET_DUMPABLE, prctl

    prctl(PR_SET_DUMPABLE, 1)  # as an exec leaves it (a uid change made it undumpable; the verifier undoes this)
    _name(module)
    if not safe_path:  # `python -m` puts the current folder first
        sys.path.insert(0, os.getcwd())
    if not hasattr(sys.modules.get(module), "__path__"):  # a package runs its __main__: keep the package
        sys.modules.pop(module, None)  # run as __main__, as in a fresh interpreter (an import gets its own copy)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code: int | str | None = 0
    try:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - what an uncaught exception does: its traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        if isinstance(code, str):
            sys.stderr.write(code + "\n")
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(int(code or 0) & 0xFF)


_ZYGOTE_ENV: dict[str, str] = {}


def _name(module: str) -> None:
    """Name this process after the module it runs (ps, top and /proc/PID/comm show it; its command line
    stays the zygote's)."""
    from course.proc import set_process_name

    set_process_name(module.rsplit(".", 1)[-1] if module != "course.sandbox" else "sandbox")


def _child(request: dict, fds: list[int], zygote: int) -> None:  # pragma: no cover - runs in the child, ends in exec or _exit
    try:
        if request.get("deathsig"):
            from course.proc import PR_SET_PDEATHSIG, prctl

            prctl(PR_SET_PDEATHSIG, int(request["deathsig"]))
            if os.getppid() != zygote:
                os._exit(1)  # the zygote ended before the signal was asked for: it would never come
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        targets = [int(t) for t in request.get("fds_at") or []][:len(fds) - 4]
        if targets:  # the caller's descriptors under its numbers: first above every number in play, then there
            import fcntl

            floor = max([*targets, *fds]) + 1
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds[4:4 + len(targets)]]
            for fd, target in zip(moved, targets):
                os.dup2(fd, target)
        from course.proc import close_descriptors_except

        close_descriptors_except({0, 1, 2, *targets})
        os.chdir(request["cwd"])
        argv, env = request["argv"], request["env"]
        module = _runnable(argv, env)
        if module is None:  # a real exec, with the signals Popen restores
            for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        from course.sandbox import wrapper

        wrapper.configure(exec_hook=exec_or_run)  # the command the wrapper sandboxes is forked from here too
        _run_module(*module, env)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"zygote: cannot start {request.get('argv', ['?'])[0]}: {exc}\n".encode())
    os._exit(127)


def draw_secret() -> int:
    """A number for one forked process alone (63 bits of ``os.urandom``)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def say_fork(report_fd: int, pid: int, env: dict, secret: int) -> None:
    """``PID RANK SECRET`` on ``report_fd`` (RANK from ``env``, ``-`` without one): the report line of a fork."""
    rank = str(env.get("RANK", "-"))
    try:
        os.write(report_fd, f"{pid} {rank if rank.isdigit() else '-'} {secret}\n".encode())
    except OSError:
        pass  # the reader is gone: nobody asks any more


def _keep_secret(secret: int) -> None:
    """In a reporting zygote's child: :data:`SECRET` is ``secret`` (in this module as the package knows it, which
    the zygote itself may not be: run as ``-m``, it is ``__main__``)."""
    module = sys.modules.get("course.sandbox.zygote")
    if module is None:
        import course.sandbox.zygote as module
    module.SECRET = secret


def serve(control_fd: int, preload: list[str], report_fd: int | None = None) -> int:
    """The zygote: import ``preload``, then fork a process per request on ``control_fd`` until it closes (each
    one's pid, RANK and secret said on ``report_fd``, see :class:`Zygote`)."""
    import importlib

    if report_fd is not None:
        from course.proc import make_undumpable

        make_undumpable()  # what it reports cannot be forged through it by the processes it forks
        os.write(report_fd, f"Z {os.getpid()}\n".encode())

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module that does not import here is imported by its user
            sys.stderr.write(f"zygote: not preloaded: {name} ({exc})\n")
    _ZYGOTE_ENV.update(_import_time_env(os.environ))
    _name("zygote")
    control = socket.socket(fileno=control_fd)
    zygote = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([control, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply = children.pop(pid, None)
            if reply is not None:
                try:
                    reply.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                reply.close()
        if control not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, _REQUEST_LIMIT, 4 + _EXTRA_FDS)
        except OSError:
            break
        if not message:
            break  # our caller is gone: so are we (what we started notices, and ends itself)
        if len(fds) < 4:
            for fd in fds:
                os.close(fd)
            continue
        reply = socket.socket(fileno=fds[3])
        secret = draw_secret() if report_fd is not None else None
        try:
            request = json.loads(message)
            pid = os.fork()
        except (ValueError, OSError) as exc:
            reply.send(json.dumps({"error": str(exc)}).encode())
            reply.close()
            for fd in fds[:3] + fds[4:]:
                os.close(fd)
            continue
        if pid == 0:
            if report_fd is not None:  # this zygote is undumpable; its child is not, from its first step: else
                from course.proc import PR_SET_DUMPABLE, prctl  # (loaded: make_undumpable came from there)

                prctl(PR_SET_DUMPABLE, 1)  # a launcher that looks at its open files then would call them hidden
                _keep_secret(secret)
            _child(request, fds, zygote)
        if report_fd is not None:
            say_fork(report_fd, pid, request.get("env", {}), secret)
        for fd in fds[:3] + fds[4:]:
            os.close(fd)
        reply.send(json.dumps({"pid": pid}).encode())
        children[pid] = reply
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else list(PRELOAD),
                   int(sys.argv[3]) if len(sys.argv) > 3 else None))
