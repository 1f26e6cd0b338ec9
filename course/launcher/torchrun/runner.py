"""Running a script under real torchrun and observing what each worker did.

:func:`run_script` launches ``python -m torch.distributed.run`` on the script through
:mod:`course.launcher.torchrun.torchrun_probe`, which records what each worker really did (its
environment, checkpoint writes and renames, optimizer steps, ``destroy_process_group``),
and returns a :class:`Run`: each :class:`Worker` as the probe saw it, the reports and
files the script wrote. Two scenarios, on the layout the caller gives (workers per agent):

* ``nodes``: torchrun agents on this machine joined by a c10d rendezvous (``--nnodes=N``; with
  several workers on a later node, LOCAL_RANK != RANK there), uninterrupted;
* ``restart``: ``--max-restarts=1``, one ``--standalone`` agent or several joined by a c10d rendezvous;
  the worker of the ``crash`` rank dies once, right after its ``crash`` step-th optimizer step, so the
  job ends right only if the script resumes from its last checkpoint.

A worker's attempt is the rendezvous round it belongs to (the workers that share WORLD_SIZE and
MASTER_PORT, in the order the rounds started), not its TORCHELASTIC_RESTART_COUNT: an agent that
restarts its workers because another node is waiting does not count that restart.

A launch costs several seconds, so runs are cached by the script's content (and the crash and layout).
A run of several agents that is left with no worker at all for :data:`STRANDED_AFTER` s is stopped: one
node's workers finished while another node's agent waits for every node to meet again (``Run.stranded``).
Nothing here knows a check or an exercise: judging a run is :mod:`course.checks.torchrun`'s part.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from course.launcher.fswatch import FileEvent, FolderWatch
from course.launcher.stall import SAMPLE, StallVerdict, StallWatch
from course.launcher.torchrun import agents
from course.launcher.torchrun.workers import PROBE_SCRIPT, ZYGOTE_NAME, ZygoteReports
from course.proc import alive
from course.sandbox.box import python_flags

NODES_TIMEOUT = 180.0
RESTART_TIMEOUT = 240.0
#: seconds with no worker on any agent, after workers ran, at which a run of several agents is over (this one
#: and the elastic run): an agent whose workers finished waits in its exit barrier (up to 300 s) while another
#: waits for it in the rendezvous (its workers failed and it restarts), until torch's timeouts
STRANDED_AFTER = 15.0

#: torchrun's agent: ``python -m torch.distributed.run``, its workers forked from a warm zygote
#: (:mod:`course.launcher.torchrun.agent`)
#: (with the zygote's flags: nothing imported from the job's folder, where the workers write, nor a user site;
#: the agent forks its workers' zygote from itself, see course.launcher.torchrun.agent)
AGENT = [sys.executable, *python_flags(), "-m", "course.launcher.torchrun.agent"]
#: the two launches every check reads (see the module doc)
Scenario = Literal["nodes", "restart"]


@dataclass
class Worker:
    """One worker process of a torchrun job, as the probe saw it."""

    pid: int
    rank: int
    local_rank: int
    world_size: int
    group_rank: int
    attempt: int  # the rendezvous round (0: the first launch), see rounds()
    events: list[dict]
    output: str = ""
    stack: str = ""

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def collectives(self) -> list[dict] | None:
        """This worker's collectives (op, group, numel) as torch's flight recorder saw them; None: not recorded
        (the worker was killed, or this torch has no flight recorder)."""
        found = [e for e in self.of("collectives") if "entries" in e]
        return found[-1]["entries"] if found else None

    @property
    def exited(self) -> bool:
        return bool(self.of("exit")) or bool(self.of("crash"))

    @property
    def name(self) -> str:
        return f"rank {self.rank} (LOCAL_RANK {self.local_rank}, node {self.group_rank}, attempt {self.attempt})"


@dataclass
class Run:
    """What one torchrun launch of the script did."""

    scenario: Scenario
    crash: tuple[int, int] | None  # (rank, optimizer step) the grader killed, in the restart run
    layout: tuple[int, ...]  # workers per torchrun agent that starts the job (one agent: --standalone)
    command: str
    returncodes: list
    timed_out: bool
    timeout: float
    elapsed: float
    log: str
    out_dir: str
    ckpt_path: str
    workers: list[Worker] = field(default_factory=list)
    reports: dict = field(default_factory=dict)  # pid -> parsed report (or an error string)
    final: object = None  # rank 0's final weights (dict), None if absent, or an error string
    ckpt_exists: bool = False
    alive_at_deadline: set = field(default_factory=set)  # pids of the job's processes still running when it timed out
    stranded: bool = False  # timed_out early: the agents waited for each other with no worker left (STRANDED_AFTER)
    stall: StallVerdict | None = None  # the deadlock the grader found in the workers' collectives (it stopped the run)
    #: what happened to the files of OUT and of the checkpoint's folder, as the kernel told the launcher (inotify):
    #: the workers cannot forge it; None where it could not be watched (``files_problem`` says why)
    files: list[FileEvent] | None = None
    files_problem: str = ""
    #: who held a file of OUT or of the checkpoint's folder open for writing, as the launcher read it from the
    #: kernel (/proc/<pid>/fd at each inotify event, in this process): pid -> {"rank": the RANK torchrun started it
    #: with, "names": {(folder, name)}}; ``files_hidden``: workers whose open files the kernel would not show
    file_writers: dict = field(default_factory=dict)
    files_hidden: set = field(default_factory=set)
    #: what the caller's ``on_crash`` returned (it ran in this process while the crashed worker waited)
    crash_note: object = None
    #: (pid, RANK, secret) of every worker a zygote forked, in the order forked, as the zygotes told this process
    #: (course.launcher.torchrun.workers.ZygoteReports): the secret is a number only that worker and this process
    #: know (an exec'd worker has none and is not listed)
    forks: list = field(default_factory=list)
    #: the elastic launch: (round key, what the caller's ``on_round`` returned) at each rendezvous round's start,
    #: run in this process before any worker of the round ran the script, then (None, its return) at the end
    round_notes: list = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """The world size the job starts with."""
        return sum(self.layout)

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.stall is None and all(rc == 0 for rc in self.returncodes)


    def attempt(self, n: int) -> list[Worker]:
        return sorted((w for w in self.workers if w.attempt == n), key=lambda w: w.rank)

    @property
    def attempts(self) -> int:
        return 1 + max((w.attempt for w in self.workers), default=0)


_CACHE: dict[tuple, Run] = {}


def _script(script: str) -> tuple[str, str]:
    """(the script's absolute path, its content's digest); FileNotFoundError when there is none."""
    path = os.path.abspath(script)
    with open(path, "rb") as fh:
        content = fh.read()
    return path, hashlib.sha256(content).hexdigest()


def run_script(script: str, scenario: Scenario, *, layout: tuple[int, ...],
               crash: tuple[int, int] | None = None, on_crash: Callable[[str], object] | None = None,
               prelude: str | None = None) -> Run:
    """Launch ``script`` for ``scenario`` ("nodes" or "restart"), or reuse the run of the same content.

    ``layout``: the workers of each agent (one number: one agent, ``--standalone`` in a restart run; several:
    agents joined by a c10d rendezvous). ``crash``: in the restart run, the (rank, optimizer step) after which
    that worker is killed once; ``on_crash(ckpt_path)`` runs in this process at that moment, before the worker
    dies and so before torchrun restarts the job (``Run.crash_note`` keeps what it returns). A missing script
    raises FileNotFoundError. ``prelude`` (``"module:function"``): every worker calls ``function(rank, secret)``
    before the script runs (its RANK, and the secret its zygote drew for it, see :attr:`Run.forks`; None when
    it was exec'd)."""
    path, digest = _script(script)
    layout = tuple(int(n) for n in layout)
    if scenario == "restart":
        if crash is None:
            raise ValueError("a restart run crashes a worker: give crash=(rank, step)")
        crash = (int(crash[0]), int(crash[1]))
        if not 1 <= len(layout) <= 2 or min(layout) < 1 or not 0 <= crash[0] < sum(layout):
            raise ValueError(f"a restart run has one or two agents and crashes one of its ranks, not {layout}, {crash}")
    else:
        crash = None
        if len(layout) < 2 or min(layout) < 1:
            raise ValueError(f"a nodes run has two agents or more, each with a worker, not {layout}")
    key = (path, digest, scenario, crash, layout, prelude)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _launch(path, scenario, crash, layout, on_crash, prelude)
    return _CACHE[key]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_env(probe_dir: str, watched: list[str], crash: tuple[int, int] | None, prelude: str | None = None) -> dict:
    env = dict(os.environ)
    for name in [k for k in env if k.startswith(("TORCHELASTIC_", "DDP_COURSE_PROBE_"))]:
        del env[name]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        DDP_COURSE_PROBE_DIR=probe_dir,
        DDP_COURSE_PROBE_WATCH=os.pathsep.join(watched),
        DDP_COURSE_PROBE_LAUNCHER=str(os.getpid()),  # each worker ends when this process is gone
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # pytorch#135712: restarts fail in Gloo connectFullMesh
        CUDA_VISIBLE_DEVICES="",  # grade on gloo/CPU everywhere, deterministically
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_FR_BUFFER_SIZE="4000",  # the flight recorder: every worker's collectives (the probe dumps them)
    )
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in [n for _, n in socket.if_nameindex()]:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # all workers are on this host; hostname lookup is flaky in containers
    if crash:
        env["DDP_COURSE_PROBE_CRASH_RANK"] = str(crash[0])
        env["DDP_COURSE_PROBE_CRASH_STEP"] = str(crash[1])
    if prelude:
        env["DDP_COURSE_PROBE_PRELUDE"] = prelude
    return env


def describe(scenario: Scenario, layout: tuple[int, ...], script: str) -> str:
    """The launch in words, as the checks name it to the student."""
    workers = " + ".join(str(n) for n in layout)
    agents = {2: "two", 3: "three"}.get(len(layout), str(len(layout)))
    if scenario == "nodes":
        return (f"the {len(layout)}-node run ({agents} torchrun agents, --nnodes={len(layout)}, c10d rendezvous, "
                f"{workers} workers)")
    if len(layout) == 1:
        return (f"the restart run (torchrun --standalone --nproc_per_node={layout[0]} --max-restarts=1 "
                f"{os.path.basename(script)})")
    return (f"the {len(layout)}-node restart run ({agents} torchrun agents, --nnodes={len(layout)}, c10d rendezvous, "
            f"{workers} workers, --max-restarts=1)")


def _commands(scenario: Scenario, layout: tuple[int, ...], job: str, tail: list[str]) -> list[list[str]]:
    torchrun = [*AGENT, "--monitor-interval=0.1"]
    restarts = f"--max-restarts={int(scenario == 'restart')}"
    if len(layout) == 1:
        return [torchrun + ["--standalone", f"--nproc_per_node={layout[0]}", restarts,
                            f"--log-dir={job}/logs0"] + tail]
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    return [
        torchrun + [f"--nnodes={len(layout)}", f"--nproc_per_node={n}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1",
                    restarts, f"--log-dir={job}/logs{i}"] + tail
        for i, n in enumerate(layout)
    ]


class _crash_handover:  # noqa: N801 - a callable with a result, used as a function
    """The crashing worker waits (its probe wrote ``crash.ready``) while this process runs ``on_crash(ckpt_path)``,
    then lets it die (``crash.go``): whatever ``on_crash`` does to the checkpoint happens between the crash and
    the restart, outside every worker."""

    def __init__(self, probe_dir: str, ckpt_path: str, on_crash: Callable[[str], object] | None):
        self.ready, self.go = os.path.join(probe_dir, "crash.ready"), os.path.join(probe_dir, "crash.go")
        self.ckpt_path, self.on_crash, self.note, self.done = ckpt_path, on_crash, None, False

    def __call__(self) -> None:
        if self.done or not os.path.exists(self.ready):
            return
        self.done = True
        try:
            if self.on_crash is not None:
                self.note = self.on_crash(self.ckpt_path)
        finally:
            open(self.go, "w").close()  # noqa: SIM115 - a marker


def _launch(script: str, scenario: Scenario, crash: tuple[int, int] | None, layout: tuple[int, ...],
            on_crash: Callable[[str], object] | None = None, prelude: str | None = None) -> Run:
    job = tempfile.mkdtemp(prefix=f"ddp-course-ex4-{scenario}-")
    try:
        out_dir, ckpt_dir, probe_dir = (os.path.join(job, d) for d in ("out", "ckpt", "probe"))
        for d in (out_dir, ckpt_dir, probe_dir):
            os.makedirs(d)
        ckpt_path = os.path.join(ckpt_dir, "ckpt.pt")
        env = _job_env(probe_dir, [out_dir, ckpt_dir], crash=crash, prelude=prelude)
        tail = [PROBE_SCRIPT, script, "--out", out_dir, "--ckpt", ckpt_path]
        commands = _commands(scenario, layout, job, tail)
        timeout = RESTART_TIMEOUT if scenario == "restart" else NODES_TIMEOUT
        logs, procs = [], []
        reports = ZygoteReports()
        # from this process, before any worker exists; it asks the kernel which of the agents' processes write
        watch = FolderWatch([ckpt_dir, out_dir], holders=lambda: reports.without_zygotes(_descendants(procs)),
                            ranks=reports.rank)
        started = time.monotonic()
        for i, cmd in enumerate(commands):
            logs.append(open(os.path.join(job, f"agent{i}.log"), "wb"))  # noqa: SIM115 - closed below
            # a session of its own (_stop kills its group), and killed when this process dies before _stop can
            procs.append(agents.start(cmd, cwd=job, env={**env, **reports.env()}, stdout=logs[-1],
                                      pass_fds=reports.fds()))
        reports.started()
        timed_out, stall, stranded = False, None, False
        alive: set[int] = set()
        handover = _crash_handover(probe_dir, ckpt_path, on_crash) if crash else None
        try:
            stall, stranded = _wait(procs, probe_dir, started + timeout, tick=handover)
            timed_out = stall is None and any(proc.poll() is None for proc in procs)
        finally:
            alive = _stop(procs, dump_stacks=timed_out or stall is not None)
            for fh in logs:
                fh.close()
        elapsed = time.monotonic() - started
        files = watch.stop()
        forks = reports.forks()
        reports.close()
        run = Run(
            scenario=scenario,
            crash=crash,
            layout=layout,
            command=describe(scenario, layout, script),
            returncodes=[p.returncode for p in procs],
            timed_out=timed_out,
            timeout=timeout,
            elapsed=elapsed,
            log="\n".join(_read(os.path.join(job, f"agent{i}.log")) for i in range(len(procs))),
            out_dir=out_dir,
            ckpt_path=ckpt_path,
            alive_at_deadline=alive if timed_out else set(),
            stall=stall,
            stranded=stranded,
            files=files,
            files_problem=watch.problem,
            file_writers=watch.writers,
            files_hidden=watch.hidden,
            crash_note=handover.note if handover else None,
            forks=forks,
        )
        _observe(run, probe_dir)
        return run
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _wait(procs: list[subprocess.Popen], probe_dir: str, deadline: float,
          tick: Callable[[], None] | None = None) -> tuple[StallVerdict | None, bool]:
    """Wait for the agents to end or the deadline; a deadlock in the workers' collectives ends it at once, and so
    do several agents left with no worker for :data:`STRANDED_AFTER` s (the second value: True). ``tick`` is
    called every 50 ms (the crash's hand-over: :func:`_crash_handover`)."""
    watch, members, starts, next_look = None, None, {}, 0.0
    busy = None  # when an agent last had a worker (None: none yet)
    while time.monotonic() < deadline:
        if all(proc.poll() is not None for proc in procs):
            return None, False
        time.sleep(0.05)
        if tick is not None:
            tick()
        if time.monotonic() < next_look:
            continue  # the agents are polled often; the workers' logs only as often as the watch samples
        next_look = time.monotonic() + SAMPLE
        if len(procs) > 1:
            if _working(procs):
                busy = time.monotonic()
            elif busy is not None and time.monotonic() - busy > STRANDED_AFTER:
                return None, True
        workers = _live_attempt(probe_dir, starts)
        if not workers:
            continue
        key = tuple(sorted((rank, pid) for rank, (pid, _) in workers.items()))
        size = max(workers) + 1
        if key != members:
            if sorted(workers) != list(range(size)):
                continue  # not every worker of the attempt has started yet
            members = key
            pids = [workers[r][0] for r in range(size)]
            watch = StallWatch(pids, [os.path.join(probe_dir, f"stall-{pid}.json") for pid in pids],
                               [os.path.join(probe_dir, f"returned-{pid}") for pid in pids])
        running = [r for r, (pid, _) in workers.items() if alive(pid)]
        finished = [r for r, (pid, exited) in workers.items() if exited and not alive(pid)]
        if len(running) + len(finished) < len(workers):
            continue  # a worker died: torchrun's own report says why
        verdict = watch.poll(sorted(running), finished=sorted(finished))
        if verdict is not None:
            return verdict, False
    return None, False


def _descendants(agents: list[subprocess.Popen]) -> list[int]:
    """The pids of every process the running agents started (their workers and what those started)."""
    import psutil

    found = []
    for proc in list(agents):
        try:
            found += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            pass
    return found


def _working(agents: list[subprocess.Popen]) -> bool:
    """Whether any running agent has a worker process now (its zygote is none: see course.launcher.torchrun.agent)."""
    import psutil

    for proc in agents:
        try:
            if proc.poll() is None and any(_is_worker(p) for p in psutil.Process(proc.pid).children(recursive=True)):
                return True
        except psutil.Error:
            pass
    return False


def _is_worker(proc) -> bool:
    import psutil

    try:
        return proc.name() != ZYGOTE_NAME and _running(proc)
    except psutil.Error:
        return False


def rounds(starts: list[tuple[int, int, tuple, float]]) -> dict[int, int]:
    """{pid: the rendezvous round it belongs to (0, 1, ...)} of workers given as (pid, rank, round key, start
    time), the key being (WORLD_SIZE, MASTER_ADDR, MASTER_PORT): a round's workers share them. Rounds are
    numbered in the order they started; a rank met twice under one key (the same port drawn again) opens a
    new round."""
    opened: list[tuple[tuple, set]] = []  # per round: its key and the ranks in it
    found = {}
    for pid, rank, key, _ in sorted(starts, key=lambda s: s[3]):
        n = next((i for i in range(len(opened) - 1, -1, -1) if opened[i][0] == key), None)
        if n is None or rank in opened[n][1]:
            opened.append((key, set()))
            n = len(opened) - 1
        opened[n][1].add(rank)
        found[pid] = n
    return found


def _round_key(env: dict) -> tuple:
    return (env.get("WORLD_SIZE"), env.get("MASTER_ADDR"), env.get("MASTER_PORT"))


def _live_attempt(probe_dir: str, starts: dict) -> dict[int, tuple[int, bool]]:
    """{rank: (pid, exited normally)} of the workers of the latest round, from the probe's event logs."""
    for path in glob.glob(os.path.join(probe_dir, "events-*.jsonl")):
        if path not in starts:
            try:
                with open(path, "rb") as fh:
                    first = json.loads(fh.readline())
                env = first["env"]
                starts[path] = (int(first["pid"]), int(env.get("RANK")), _round_key(env), float(first["t"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    if not starts:
        return {}
    numbers = rounds(list(starts.values()))
    latest = max(numbers.values())
    found = {}
    for path, (pid, rank, _, _) in starts.items():
        if numbers[pid] != latest:
            continue
        try:
            with open(path, "rb") as fh:
                exited = b'"event": "exit"' in fh.read()[-400:]
        except OSError:
            exited = False
        found[rank] = (pid, exited)
    return found


def _stop(procs: list[subprocess.Popen], dump_stacks: bool) -> set[int]:
    """End every agent and worker of the job (workers run in sessions of their own); the pids that were alive."""
    import psutil

    victims = []
    for proc in procs:
        try:
            victims += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    alive = {v.pid for v in victims if _running(v)}
    if dump_stacks:  # stuck workers: ask them where they are (faulthandler, installed by the probe)
        for victim in victims:
            try:
                victim.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
        time.sleep(0.5)
    for pid in [p.pid for p in procs] + [v.pid for v in victims]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return alive


def _running(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "backslashreplace")
    except OSError:
        return ""


def _observe(run: Run, probe_dir: str) -> None:
    for events_path in glob.glob(os.path.join(probe_dir, "events-*.jsonl")):
        events = []
        for line in _read(events_path).splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass  # a line cut short by a kill
        start = next((e for e in events if e["event"] == "start"), None)
        if start is None:
            continue
        env, pid = start["env"], start["pid"]

        def num(name, env=env):
            try:
                return int(env.get(name))
            except (TypeError, ValueError):
                return -1

        run.workers.append(Worker(
            pid=pid, rank=num("RANK"), local_rank=num("LOCAL_RANK"), world_size=num("WORLD_SIZE"),
            group_rank=num("GROUP_RANK"), attempt=0, events=events,
            output=_read(os.path.join(probe_dir, f"output-{pid}.log")),
            stack=_read(os.path.join(probe_dir, f"stack-{pid}.txt")),
        ))
    numbers = rounds([(w.pid, w.rank, _round_key(w.of("start")[0]["env"]), float(w.of("start")[0].get("t") or 0))
                      for w in run.workers])
    for w in run.workers:
        w.attempt = numbers[w.pid]
    run.workers.sort(key=lambda w: (w.attempt, w.rank))
    for worker in run.workers:
        path = os.path.join(run.out_dir, f"report-{worker.pid}.json")
        if os.path.exists(path):
            try:
                run.reports[worker.pid] = json.loads(_read(path))
            except ValueError as exc:
                run.reports[worker.pid] = f"unreadable JSON ({exc})"
    final = os.path.join(run.out_dir, "final.pt")
    if os.path.exists(final):
        try:
            state = torch.load(final, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise TypeError(f"it holds a {type(state).__name__}, not a state_dict")
            run.final = dict(state)  # as the script saved it: whether its keys fit a model is the checks' to say
        except Exception as exc:  # noqa: BLE001 - reported to the student
            run.final = f"{type(exc).__name__}: {exc}"
    run.ckpt_exists = os.path.exists(run.ckpt_path)
