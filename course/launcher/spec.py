"""What one rank process is given (:class:`RankSpec`), shared by the caller's side (:mod:`course.launcher.job`)
and the rank's (:mod:`course.launcher.rank`), and how a job makes them (:func:`job_specs`)."""

from __future__ import annotations

import linecache
import os
import socket
import sys
from dataclasses import dataclass

from course.envnames import BACKEND_ENV, CHECK_PACKAGES_ENV
from course.launcher.settings import SETTINGS


@dataclass
class RankSpec:
    """Everything a rank needs from its launcher; it travels to the rank by pickle."""

    #: ``(fn, args)``, pickled by value (:func:`course.launcher.job.dumps`)
    payload: bytes
    #: the rank's whole environment (the torchrun variables included)
    env: dict[str, str]
    cwd: str
    #: the launching process: the rank ends itself when it disappears
    parent_pid: int
    num_threads: int
    #: notebook cells' source lines (linecache entries), so tracebacks can show the student's code
    linecache: dict
    #: notebook cell file -> how IPython names it ("Cell In[7]")
    cell_names: dict[str, str]
    #: the engine's and the check packages' folders: their frames are hidden from the student's traceback
    grader_dirs: list[str]
    #: everything the rank prints
    log_path: str
    #: what ``fn`` returned, or what it raised (cloudpickled or, when ``safe``, torch.save'd dicts)
    result_path: str
    error_path: str
    #: the stall probe's answer (see :mod:`course.launcher.stall`)
    probe_path: str
    #: the caller does not trust the rank: reports hold only what ``torch.load(weights_only=True)`` reads
    safe: bool
    timeout: float
    #: the job's FileStore (the ranks' rendezvous)
    store_path: str


def job_specs(payload: bytes, world_size: int, port: int, backend_name: str, env: dict | None, jobdir: str,
              num_threads: int, safe: bool, timeout: float) -> list[RankSpec]:
    """One :class:`RankSpec` per rank of a job whose files live in ``jobdir``."""
    sources, cell_names, grader_dirs = _notebook_sources(), _cell_names(), _grader_dirs()
    return [
        RankSpec(
            payload=payload,
            env=_rank_env(rank, world_size, port, backend_name, env),
            cwd=os.getcwd(),
            parent_pid=os.getpid(),
            num_threads=num_threads,
            linecache=sources,
            cell_names=cell_names,
            grader_dirs=grader_dirs,
            log_path=os.path.join(jobdir, f"rank{rank}.log"),
            result_path=os.path.join(jobdir, f"rank{rank}.result"),
            error_path=os.path.join(jobdir, f"rank{rank}.error"),
            probe_path=os.path.join(jobdir, f"rank{rank}.probe"),
            safe=safe,
            timeout=timeout,
            store_path=os.path.join(jobdir, "store"),
        )
        for rank in range(world_size)
    ]


def _cell_names() -> dict[str, str]:
    names = dict(SETTINGS.cell_names)
    shell = None
    if "IPython" in sys.modules:
        try:
            shell = sys.modules["IPython"].get_ipython()
        except Exception:  # noqa: BLE001 - no IPython, or a broken one: plain file names then
            shell = None
    filename_map = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(filename_map, dict):
        names.update({str(name): f"Cell In[{number}]" for name, number in filename_map.items()})
    return names


def _grader_dirs() -> list[str]:
    """The engine's folder and those of the check packages this process imported (``graders``, ...)."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    extra = [n.strip() for n in os.environ.get(CHECK_PACKAGES_ENV, "").split(",")]
    for name in ["graders", *[n for n in extra if n.isidentifier()]]:
        module = sys.modules.get(name)
        dirs += [os.path.abspath(p) for p in getattr(module, "__path__", None) or []]
    return dirs


def _notebook_sources() -> dict:
    """Source lines of notebook cells, so rank tracebacks can show the student's code."""
    return {
        name: entry
        for name, entry in list(linecache.cache.items())
        if isinstance(entry, tuple)
        and len(entry) == 4
        and (name.startswith("<") or "ipykernel_" in name)
    }


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _rank_env(rank: int, world_size: int, port: int, backend_name: str, extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher hosts the store, like torchrun's agent
        PYTHONUNBUFFERED="1",
    )
    env[BACKEND_ENV] = backend_name
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the flight recorder: each rank's collectives (stall probe)
    env.setdefault("OMP_NUM_THREADS", "1")
    if backend_name == "gloo" and "GLOO_SOCKET_IFNAME" not in env:
        # gloo picks an interface from the hostname, which is flaky on CI
        # machines and containers; all ranks are on this host, so use loopback.
        lo = _loopback_interface()
        if lo:
            env["GLOO_SOCKET_IFNAME"] = lo
    env.pop("TORCHELASTIC_RUN_ID", None)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env
