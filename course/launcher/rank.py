"""The rank side of :func:`course.launcher.job.launch`: what runs inside each rank process.

Each rank process is forked from a warm forkserver that has this module (and
torch) preloaded. ``rank_main`` sets the process up like a torchrun worker,
runs the shipped function, and reports back through files in the job folder:
``rank{r}.log`` (everything the rank printed), ``rank{r}.result`` or
``rank{r}.error`` (cloudpickled dicts). It never returns: it ends with
``os._exit`` so that no interpreter teardown (and none of its known deadlocks)
runs in a rank.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import json
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import cloudpickle

from course.launcher import writes
from course.launcher.spec import RankSpec

# Keeps process groups alive after the student's destroy_process_group():
# freeing a DDP model after its process group is gone deadlocks inside
# ~ProcessGroupGloo in forked children (DESIGN.md). Holding a reference here
# and leaving with os._exit means that destructor never runs.
_KEEP_ALIVE: list = []
_STATE = {"destroy_called": False}
_LOG_FILE = None  # faulthandler needs the file object to stay open
# What the rank's own reporting calls, bound when this module is imported (in the forkserver, before any job):
# code a student's objects run as they are unpickled, or later, cannot swap what reports the harness's result
# or ends the rank. torch's save is bound in rank_main, before the payload is unpickled.
_BOUND = {"dumps": cloudpickle.dumps, "replace": os.replace, "open": open, "exit": os._exit,
          "import": importlib.import_module, "Unpickler": pickle.Unpickler}


def _redirect_output(log_path: str) -> None:
    global _LOG_FILE
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    _LOG_FILE = sys.stderr
    # On a deadline the launcher sends SIGUSR1 to learn where a rank is stuck.
    faulthandler.register(signal.SIGUSR1, file=_LOG_FILE, all_threads=False, chain=False)


def watch_parent(parent_pid: int) -> None:
    """End this process (and its process group: a rank, a torchrun worker and their children) once the launching
    process ``parent_pid`` is gone, killed before it could stop its job (checked every 0.5 s, by a thread)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                try:
                    os.killpg(0, signal.SIGKILL)
                finally:
                    os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="ddp-course-parent-watch", daemon=True).start()


def destroyed_groups(group, c10d) -> list:
    """The process groups ``destroy_process_group(group)`` destroys (``c10d``: torch.distributed.distributed_c10d):
    every group for the default one (None or WORLD), else ``group``. Kept referenced until the process's os._exit
    (here and in torchrun's probe), they are never torn down: freeing a DDP model after its group was destroyed
    otherwise runs ~ProcessGroupGloo, which joins gloo's threads holding the GIL while one of them may need it to
    free a backward's collective (torch 2.13 then hangs at the end of a finished script)."""
    if group is None or group is c10d.GroupMember.WORLD:
        return list(c10d._world.pg_map.keys())
    return [group]


def _patch_destroy() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    real_destroy = c10d.destroy_process_group

    def destroy_process_group(group=None):
        world = group is None or group is c10d.GroupMember.WORLD
        if world:
            _STATE["destroy_called"] = True
            _STATE["destroys"] = _STATE.get("destroys", 0) + 1
        _KEEP_ALIVE.extend(destroyed_groups(group, c10d))
        real_destroy(group)
        if world:
            # torch restarts group names at "0" after a full destroy, so a second
            # init_process_group in this job would read the first one's addresses
            # from the launcher's store and hang. Every rank destroys in the same
            # order, so this keeps names unique and still agreed on by all ranks.
            c10d._world.group_count = 1000 * _STATE["destroys"]

    destroy_process_group.__doc__ = real_destroy.__doc__
    destroy_process_group.__wrapped__ = real_destroy
    dist.destroy_process_group = destroy_process_group
    c10d.destroy_process_group = destroy_process_group


def _student_traceback(exc: BaseException, hidden=(), cell_names: dict | None = None) -> str:
    """The traceback the student should read: their own frames, named as they know them.

    Dropped: this module's frames, and those under ``hidden`` (the folders of the code that called
    the student's: the engine and the check packages, e.g. ``graders/``); kept: the student's code and
    the libraries it called. A notebook cell's file (``/tmp/ipykernel_123/456.py``) is named as
    IPython names it (``cell_names``): ``Cell In[7], line 3``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    hidden = tuple(hidden)
    te = traceback.TracebackException(type(exc), exc, tb, compact=True)
    seen, todo = set(), [te]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = traceback.StackSummary.from_list(
            [f for f in current.stack if not under(f.filename, hidden)])
        todo += [t for t in (current.__cause__, current.__context__) if t is not None]
    text = "".join(te.format())
    for name, label in (cell_names or {}).items():
        text = text.replace(f'File "{name}", line', f"{label}, line")
    return text


# --------------------------------------------------------------------------- the stall probe
#
# When every rank of a job has been idle for a while, the launcher asks each one (a request file
# next to its log) where it is: a thread started before the student's code answers with the
# rank's recent collectives, as torch's flight recorder saw them (the launcher sets
# TORCH_FR_BUFFER_SIZE; on gloo each entry stays "scheduled": no completion), and the main
# thread's stack (is it inside a collective? on which line of the student's code?). The
# launcher compares the answers (course.launcher.stall). Student code can break this thread only
# to lose the early diagnosis: the job's deadline still holds.


def start_stall_probe(spec: dict):
    """Start the probe thread; returns the function that answers (a worker may call it as it exits).

    ``spec``: where to answer (``probe_path``) and how to name frames (``grader_dirs``, ``cell_names``), from a
    rank's :class:`~course.launcher.spec.RankSpec` or a torchrun worker's probe."""
    path = spec.get("probe_path")
    if not path:
        return None
    main = threading.main_thread().ident
    hidden = tuple(spec.get("grader_dirs", ())) + (os.path.dirname(os.path.abspath(__file__)),)
    import sysconfig

    libraries = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    names = dict(spec.get("cell_names") or {})
    from course.launcher.recorder import bind, entry_of

    recorded = bind()
    exists, unlink, replace = os.path.exists, os.unlink, os.replace

    def answer() -> None:
        entries = []
        if recorded is not None:
            try:
                entries = [entry_of(e) for e in recorded()[-16:]]
            except Exception:  # noqa: BLE001 - no flight recorder answer: the launcher decides nothing
                entries = None
        frame = sys._current_frames().get(main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        waiting = waiting_in_collective(stack)  # a rendezvous may wait for a late peer: not waiting
        site = None
        for f in reversed(stack):  # the innermost frame of the student's code
            if f.filename.startswith(("<frozen", "<string>")) or under(f.filename, hidden + libraries):
                continue
            label = names.get(f.filename) or f'File "{f.filename}"'
            site = {"where": f"{label}, line {f.lineno}", "line": (f.line or "").strip(), "function": f.name}
            break
        data = json.dumps({"t": time.time(), "entries": entries, "waiting": waiting, "site": site,
                           "p2p": point_to_point(frame) if waiting else None})
        with open(path + ".tmp", "w") as fh:
            fh.write(data)
        replace(path + ".tmp", path)

    def loop() -> None:
        writes.grader_thread()
        while True:
            time.sleep(0.1)
            if exists(path + ".req"):
                try:
                    unlink(path + ".req")
                    answer()
                except Exception:  # noqa: BLE001 - never disturb the rank
                    pass

    threading.Thread(target=loop, name="ddp-course-stall-probe", daemon=True).start()
    return answer


#: a main thread in these functions is joining a group (waiting in a store for its peers), not in a collective
JOINING = frozenset({"init_process_group", "new_group", "new_subgroups", "_new_process_group_helper",
                      "_store_based_barrier", "rendezvous", "init_device_mesh"})
#: an idle main thread in this code waits for a collective: torch.distributed's functions, DDP's forward
#: (buffer broadcasts), and a backward (DDP's gradient all-reduce finishes inside it)
COLLECTIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/torch/autograd/graph.py")


def waiting_in_collective(stack, also_not: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a thread with this ``stack`` (``traceback.extract_stack``) waits in torch's collective code, not in a
    rendezvous (:data:`JOINING`) nor in a function of ``also_not``: the one rule of "is this rank in a collective"."""
    return (any(code in f.filename.replace(os.sep, "/") for f in stack for code in COLLECTIVE_CODE)
            and not any(f.name in JOINING or f.name in also_not for f in stack))


#: torch.distributed's blocking point-to-point functions, and the argument naming the peer (a global rank): a rank
#: idle in one waits for that peer (on gloo, a send too: it returns once the peer has received, measured on 2.13)
POINT_TO_POINT = {"send": "dst", "recv": "src"}


def point_to_point(frame) -> dict | None:
    """{"op": "send" or "recv", "peer": the global rank it waits for, or None (any source, or a group's rank)} when
    the thread whose innermost ``frame`` this is waits in a blocking point-to-point function of
    ``torch.distributed`` (its innermost frame there); None when it waits in another (a collective) or none."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith("/torch/distributed/distributed_c10d.py"):
            if code.co_name not in POINT_TO_POINT:
                return None
            try:  # the frame is blocked in C: its arguments are still its locals
                found = frame.f_locals
                peer = found.get(POINT_TO_POINT[code.co_name])
                peer = int(peer) if isinstance(peer, int) and found.get("group") is None else None
            except Exception:  # noqa: BLE001 - unknown peer: the launcher treats it as any
                peer = None
            return {"op": code.co_name, "peer": peer}
        frame = frame.f_back
    return None


def under(filename: str, places: tuple[str, ...]) -> bool:
    """Whether ``filename`` lies in one of the folders ``places``."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return any(path.startswith(p.rstrip(os.sep) + os.sep) for p in places)


def _write(path: str, obj: dict, safe: bool) -> None:
    """Write a report for the launcher. ``safe``: only data torch.load(weights_only=True) accepts
    (tensors, numbers, strings, lists, dicts), so a launcher that must not trust the rank can read it.
    Through the references of :data:`_BOUND`, taken before any student code ran in this process."""
    tmp = path + ".tmp"
    with _BOUND["open"](tmp, "wb") as fh:
        if safe:
            save = _BOUND.get("torch_save")
            if save is None:
                import torch

                save = torch.save
            save(obj, fh)
        else:
            fh.write(_BOUND["dumps"](obj))
    _BOUND["replace"](tmp, path)


#: the modules a rank imports, after the harness and before the student's objects, whatever the harness is
BOUND_FIRST = ("course.checks",)


def _harness_modules(fn) -> list[str]:
    """The modules of ``fn`` (a function, or a partial or bound method of one), outermost first."""
    names, todo, seen = [], [fn], set()
    while todo and len(seen) < 8:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        name = getattr(current, "__module__", None)
        if isinstance(name, str) and name not in names:
            names.append(name)
        todo += [inner for inner in (getattr(current, "func", None), getattr(current, "__func__", None)) if inner]
    return names


def load_payload(payload: bytes):
    """``(fn, args)`` from a job's payload, in two stages (:func:`course.launcher.job.dumps_payload` wrote them so).

    First the harness ``fn``; then its module and :data:`BOUND_FIRST` (the check API, with the torch functions it
    captures) are imported, so every reference they bind at import is bound now; only then the arguments, where
    the student's objects are: code that runs as those are unpickled (a class-creation hook, a ``__reduce__``, a
    default argument's constructor) comes after everything the harness's modules took at import. One unpickler
    reads both, so an object shared by the function and its arguments stays one object."""
    unpickler = _BOUND["Unpickler"](io.BytesIO(payload))
    fn = unpickler.load()
    for name in (*_harness_modules(fn), *BOUND_FIRST):
        if name == "__main__" or name.startswith("__"):
            continue
        try:
            _BOUND["import"](name)
        except Exception:  # noqa: BLE001 - a function pickled by value from a module this rank cannot import
            pass
    args = unpickler.load()
    return fn, args


def _rendezvous_through_file(spec: RankSpec) -> None:
    """Rendezvous at the launcher's MASTER_ADDR:MASTER_PORT goes through a FileStore in the job folder.

    Every TCPStore connection makes c10d format both ends' addresses with a
    reverse DNS lookup of 127.0.0.1 (on the rank and on the launcher); where the
    resolver drops a query under load, each one costs its 5 s timeout, and
    concurrent jobs hit it every other job (measured: 5.0 s in init_process_group
    on all ranks). A FileStore needs no socket. Any other address is untouched.
    """
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function
    real = rendezvous._create_c10d_store
    env = spec.env

    def create_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if hostname == env["MASTER_ADDR"] and int(port) == int(env["MASTER_PORT"]):
            return _file_store(spec, timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # as under torchrun, ranks only connect to the store the launcher hosts: nobody hosts this one
            raise RuntimeError(
                f"init_process_group was told to meet at {hostname}:{port}, but this job's rendezvous is at "
                f"MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}, which the launcher set (as "
                f"torchrun does) and hosts. Nobody hosts a store at {hostname}:{port}: every rank would wait "
                "there forever. Remove the code that sets MASTER_ADDR/MASTER_PORT (os.environ[...] = ...) or "
                "passes init_method: dist.init_process_group(backend) reads the launcher's from the environment."
            )
        return real(hostname, port, rank, world_size, timeout, use_libuv)

    create_store.__wrapped__ = real
    rendezvous._create_c10d_store = create_store


def _file_store(spec: RankSpec, timeout):
    from torch.distributed import FileStore

    store = FileStore(spec.store_path, -1)  # -1: never deletes the file; the job folder goes at the end
    store.set_timeout(timeout)
    return store


def _finish_barrier(spec: RankSpec) -> None:
    """Leave only once every rank has returned from ``fn``.

    A rank that exits while its peers are still connecting (init_process_group
    builds a full mesh) makes them fail with "Connection closed by peer": wait
    on the job's store. If a peer fails instead, the launcher kills this rank,
    whose result is already written.
    """
    from datetime import timedelta

    env = spec.env
    try:
        store = _file_store(spec, timedelta(seconds=spec.timeout))
        if store.add("ddp_course/finished", 1) >= int(env["WORLD_SIZE"]):
            store.set("ddp_course/all_finished", "1")
        store.wait(["ddp_course/all_finished"])
    except Exception:  # noqa: BLE001 - the launcher decides what a missing peer means
        pass


def _pg_initialized() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def rank_main(rank: int, specs: list[RankSpec]) -> None:
    """Entry point, called by torch.multiprocessing as ``rank_main(rank, specs)`` (one spec per rank)."""
    spec = specs[rank]
    # Everything preloaded by the forkserver (torch and friends) is long-lived:
    # keep the collector from walking it (and copying its pages) in every rank.
    gc.freeze()
    try:
        os.setsid()  # own process group: the launcher kills rank + children at once
    except OSError:
        pass
    _redirect_output(spec.log_path)
    watch_parent(spec.parent_pid)
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.cwd)
    for name, entry in spec.linecache.items():
        linecache.cache.setdefault(name, entry)

    import torch

    torch.set_num_threads(spec.num_threads)
    _BOUND["torch_save"] = torch.save
    _patch_destroy()
    writes.install()  # before the payload is unpickled: whatever the student's code binds is already seen
    start_stall_probe({"probe_path": spec.probe_path, "grader_dirs": spec.grader_dirs, "cell_names": spec.cell_names})
    _rendezvous_through_file(spec)

    code = 0
    try:
        fn, args = load_payload(spec.payload)
        value = fn(rank, *args)
        try:
            _write(
                spec.result_path,
                {
                    "value": value,
                    "pg_initialized": _pg_initialized(),
                    "destroy_called": _STATE["destroy_called"],
                },
                spec.safe,
            )
        except Exception as exc:  # the value could not be pickled
            raise TypeError(
                f"rank {rank} returned a {type(value).__name__} that cannot be sent "
                f"back to the launcher ({exc}); return plain Python values or tensors"
            ) from None
        _finish_barrier(spec)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        code = 1
        report = {"traceback": "", "type": "", "message": "", "exception": None}
        try:  # str() of a hostile exception can raise too
            report.update(traceback=_student_traceback(exc, spec.grader_dirs, spec.cell_names),
                          type=type(exc).__name__, message=str(exc))
        except BaseException:  # noqa: BLE001
            report.update(type=type(exc).__name__, message="(the exception could not be printed)")
        if not spec.safe:
            try:
                report["exception"] = cloudpickle.dumps(exc)
            except Exception:
                pass
        try:
            _write(spec.error_path, report, spec.safe)
        except Exception:
            sys.stderr.write(report["traceback"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            _BOUND["exit"](code)
