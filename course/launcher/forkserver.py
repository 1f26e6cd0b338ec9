"""The ranks' warm forkserver: started once per process with torch preloaded; every rank is forked from it.

Ranks are forked from a multiprocessing *forkserver* with torch, torch.distributed and
torch._dynamo preloaded (:data:`PRELOAD`), through ``torch.multiprocessing.start_processes``:
fork speed after the first job, safe when the caller has initialised CUDA or runs threads
(a Jupyter kernel). A process with nothing to hide and no thread of its own may fork the
forkserver from itself instead (:attr:`course.launcher.settings.Settings.fork_forkserver`).
Entry points: :func:`ensure_running`, :func:`start`.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import threading

from course.launcher import gpus
from course.launcher.settings import SETTINGS
from course.proc import PR_SET_DUMPABLE, close_descriptors_except, prctl, set_process_name

#: what the ranks' forkserver imports before it forks them
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "course.launcher.rank"]
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch.cuda.is_available() without initialising CUDA



def _forkserver_log() -> str:
    """Where the forkserver's output goes: found when it starts (a process forked from a zygote gets its
    temporary folder, TMPDIR, after this module was imported)."""
    return os.path.join(tempfile.gettempdir(), f"ddp-course-forkserver-{os.getuid()}.log")


_NO_MAIN = threading.local()


def ensure_running():
    """The forkserver context, started with torch preloaded and its output kept off the caller's.

    The forkserver inherits the caller's stdout/stderr; in a Jupyter kernel those
    are the cells' streams, and nbgrader zeroes a test cell with any stderr. So
    it starts with both pointed at a log file (the ranks redirect their own output).
    """
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    # Only effective before the forkserver first starts; later calls are harmless.
    ctx.set_forkserver_preload(PRELOAD)
    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        saved = [os.dup(1), os.dup(2)]
        log = os.open(_forkserver_log(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # The forkserver must not initialise CUDA (a rank forked after cuInit cannot use the GPU):
        # if anything it preloads asks torch.cuda.is_available(), NVML answers instead of the driver.
        nvml_before = os.environ.get(_NVML_CHECK)
        os.environ[_NVML_CHECK] = "1"
        try:
            os.dup2(log, 1)
            os.dup2(log, 2)
            if not (SETTINGS.fork_forkserver and _fork_forkserver(server)):
                forkserver.ensure_running()
        finally:
            if nvml_before is None:
                os.environ.pop(_NVML_CHECK, None)
            else:
                os.environ[_NVML_CHECK] = nvml_before
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, log):
                os.close(fd)
    return ctx


def _fork_forkserver(server) -> bool:
    """Start multiprocessing's forkserver by forking this process; False (nothing started) where that is unsafe.

    What ``ForkServer.ensure_running`` does, with ``os.fork()`` in place of a new interpreter: the child keeps
    only the listener, the "alive" pipe and stdin/stdout/stderr (every other descriptor of this process is
    closed, its private channels included), is made dumpable again (as a freshly started forkserver is), and
    serves with nothing left to preload. Unsafe, so refused: another Python thread in this process (a fork
    copies locks it may hold), the CUDA driver used (a rank forked after cuInit cannot use the GPU; torch's
    ``is_initialized`` misses a ``torch.cuda.is_available()``, so :func:`~course.launcher.gpus.driver_used` asks), a preload
    module not imported yet, or a multiprocessing whose forkserver lacks the attributes used here.
    """
    from multiprocessing import connection, resource_tracker, util
    from multiprocessing import forkserver as fs

    if threading.active_count() != 1 or not all(name in sys.modules for name in PRELOAD):
        return False
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized() or gpus.driver_used() or not all(
            hasattr(server, a) for a in ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")):
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return False  # one is there (ensure_running checks it is alive)
        resource_tracker.ensure_running()
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the forkserver; ends in os._exit
            code = 1
            try:
                close_descriptors_except({0, 1, 2, listener.fileno(), alive_r})
                devnull = os.open(os.devnull, os.O_RDONLY)  # our stdin (the verifier's request) is not theirs
                os.dup2(devnull, 0)
                os.close(devnull)

                prctl(PR_SET_DUMPABLE, 1)
                set_process_name("forkserver")  # for ps (its command line is ours)
                fs.main(listener.fileno(), alive_r, [])
                code = 0
            except SystemExit:
                code = 0
            except BaseException:  # noqa: BLE001 - said in the forkserver's log (our stderr)
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _preparation_data(name):
    """multiprocessing's preparation data, minus re-running the caller's ``__main__`` in ranks.

    Functions travel by value, so ranks never need the caller's main module; not
    importing it means a script without an ``if __name__ == "__main__":`` guard
    works, and nothing at its top level runs again on every rank.
    """
    data = _ORIGINAL_PREPARATION_DATA(name)
    if getattr(_NO_MAIN, "active", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


def _install_preparation_hook() -> None:
    global _ORIGINAL_PREPARATION_DATA
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "__module__", "") != __name__:
        _ORIGINAL_PREPARATION_DATA = spawn.get_preparation_data
        spawn.get_preparation_data = _preparation_data


_ORIGINAL_PREPARATION_DATA = None


def start(entry, args: tuple, nprocs: int):
    """``torch.multiprocessing.start_processes(entry, args, nprocs)`` from the forkserver, without re-running
    the caller's ``__main__`` in the ranks (see :func:`_preparation_data`); returns its context."""
    import torch.multiprocessing as tmp

    _install_preparation_hook()
    _NO_MAIN.active = True
    try:
        return tmp.start_processes(entry, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    finally:
        _NO_MAIN.active = False
