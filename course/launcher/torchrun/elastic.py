"""An elastic torchrun launch: a node leaves the job, later another joins, and the job goes on each time.

How it works: three torchrun agents on this machine share one c10d rendezvous on 127.0.0.1
(``--nnodes=1:2``, ``--max-restarts=3``), each worker running the script through
:mod:`~course.launcher.torchrun.torchrun_probe`; a :class:`Plan` says how many workers each node has and when
things happen (the caller's story, e.g. A 2 workers, B 1, C 1):

1. node A (it hosts the rendezvous store) and node B start together: world size ``a + b``;
2. B's workers leave after their ``leave_step``-th optimizer step (mid-epoch): the first SIGKILLs its own agent,
   each exits, as a machine that dies. A's workers lose their peers, A meets the rendezvous again and restarts
   them alone: world size ``a`` (a failure restart: it counts against ``--max-restarts``);
3. the probe holds that smaller job before its optimizer step ``hold_steps + 1``; seeing it held, the grader
   starts node C, and A restarts its workers with C's: world size ``a + c`` (a membership change: it does not
   count against ``--max-restarts``, and C's workers start with TORCHELASTIC_RESTART_COUNT=0).

Every worker waits at the probe's gate before it runs the script: at the first worker of each new rendezvous round
(the old round's workers all gone), the caller's ``on_round`` runs here, in the launcher's process (the check
reads, and may change, the checkpoint the new round will load), and ``Run.round_notes`` keeps what it returned.

The rendezvous settings are those :mod:`benchmarks.elastic_bench` measured here: ``last_call_timeout=2`` (an
integer: "2.0" makes the agent exit at once) and keep-alive 1 s x 4 (1 s x 2 let a joining node form a job of
its own under load). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agent's shared store a grown job waits
for MASTER_ADDR until a DistStoreError. The result is a :class:`~course.launcher.torchrun.runner.Run` of every
worker of every round; the workers of one round share WORLD_SIZE and MASTER_PORT (:func:`rounds`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from course.launcher.fswatch import FolderWatch
from course.launcher.torchrun import agents
from course.launcher.torchrun.runner import (
    AGENT,
    PROBE_SCRIPT,
    STRANDED_AFTER,
    Run,
    Worker,
    _free_port,
    _job_env,
    _observe,
    _read,
    _round_key,
    _script,
    _stop,
    _working,
)

ELASTIC_TIMEOUT = 150.0
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4"


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Plan:
    """One elastic story: the workers of nodes A, B and C, B's departure after its ``leave_step``-th optimizer
    step, C's arrival once the smaller job made ``hold_steps`` steps."""

    nodes: tuple[int, int, int] = (2, 1, 1)
    leave_step: int = 2
    hold_steps: int = 3

    def __post_init__(self) -> None:
        # every node has a worker, so the smaller job's size (what the probe's hold keys on) is no other job's
        if len(self.nodes) != 3 or min(self.nodes) < 1 or self.leave_step < 1 or self.hold_steps < 1:
            raise ValueError(f"an elastic plan needs three nodes with a worker each and steps >= 1: {self}")

    @property
    def sizes(self) -> tuple[int, int, int]:
        """The world sizes of the story's three jobs: before B left, after, after C joined."""
        a, b, c = self.nodes
        return a + b, a, a + c

    def describe(self) -> str:
        a, b, c = self.nodes
        return (f"the elastic run (three torchrun agents, --nnodes=1:2, c10d rendezvous: nodes A ({_workers(a)}) "
                f"and B ({_workers(b)}) start, B leaves after its optimizer step {self.leave_step}, A goes on "
                f"alone for {self.hold_steps} step(s), then node C ({_workers(c)}) joins)")


_CACHE: dict[tuple, Run] = {}


def run_elastic(script: str, *, plan: Plan, input_features: int = 0,
                on_round: Callable[[str, bool], object] | None = None) -> Run:
    """Launch ``script`` elastically as ``plan`` says (see the module doc), or reuse the run of the same
    content and plan. ``input_features``: the probe logs the rows of every module input of that many features
    (which samples each step trained on); 0 logs none. ``on_round(ckpt_path, True)`` runs in this process at the
    start of every rendezvous round, before any worker of the round runs the script (each waits at the probe's
    gate), the old round's workers all gone; ``on_round(ckpt_path, False)`` once more when the job is over:
    ``Run.round_notes`` keeps what each returned. A missing script raises FileNotFoundError."""
    path, digest = _script(script)
    key = (path, digest, plan, input_features, on_round)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _launch(path, plan, input_features, on_round)
    return _CACHE[key]


def rounds(run: Run) -> list[list[Worker]]:
    """The workers of each rendezvous round (one torchrun "attempt" of the whole job: the workers that share
    WORLD_SIZE and MASTER_PORT, see :func:`~course.launcher.torchrun.runner.rounds`), in the order they
    started, each round sorted by rank."""
    return [run.attempt(n) for n in range(run.attempts) if run.attempt(n)]


def node(w: Worker) -> str:
    """The agent ("A", "B" or "C") that started the worker."""
    return w.of("start")[0]["env"].get("DDP_COURSE_PROBE_NODE") or "?"


def _held(probe_dir: str) -> bool:
    for path in glob.glob(os.path.join(probe_dir, "events-*.jsonl")):
        with open(path, "rb") as fh:
            if b'"event": "hold"' in fh.read():
                return True
    return False


class _Gates:
    """The probe's gate (``gate-PID.ready`` / ``gate-PID.go``): the first worker of every new round (its key, as
    :func:`~course.launcher.torchrun.runner.rounds` reads it) is let go once ``on_round`` returned."""

    def __init__(self, probe_dir: str, ckpt_path: str, on_round: Callable[[str, bool], object] | None):
        self.probe_dir, self.ckpt_path, self.on_round = probe_dir, ckpt_path, on_round
        self.released: set[str] = set()
        self.last: tuple | None = None  # the latest round's key and the ranks met in it
        self.notes: list[tuple] = []

    def note(self, starting: bool) -> object:
        if self.on_round is None:
            return None
        try:
            return self.on_round(self.ckpt_path, starting)
        except Exception as exc:  # noqa: BLE001 - the caller's own failure, kept for it to read
            return f"{type(exc).__name__}: {exc}"

    def tick(self) -> None:
        for ready in sorted(glob.glob(os.path.join(self.probe_dir, "gate-*.ready"))):
            pid = os.path.basename(ready)[len("gate-"):-len(".ready")]
            if pid in self.released:
                continue
            try:
                with open(os.path.join(self.probe_dir, f"events-{pid}.jsonl"), "rb") as fh:
                    env = json.loads(fh.readline())["env"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # its start event is not written yet
            key, rank = _round_key(env), env.get("RANK")
            if self.last is None or self.last[0] != key or rank in self.last[1]:
                self.last = (key, set())
                self.notes.append((key, self.note(True)))
            self.last[1].add(rank)
            open(os.path.join(self.probe_dir, f"gate-{pid}.go"), "w").close()  # noqa: SIM115 - a marker
            self.released.add(pid)


def _launch(script: str, plan: Plan, input_features: int,
            on_round: Callable[[str, bool], object] | None = None) -> Run:
    job = tempfile.mkdtemp(prefix="ddp-course-ex4-elastic-")
    try:
        out_dir, ckpt_dir, probe_dir = (os.path.join(job, d) for d in ("out", "ckpt", "probe"))
        for d in (out_dir, ckpt_dir, probe_dir):
            os.makedirs(d)
        ckpt_path = os.path.join(ckpt_dir, "ckpt.pt")
        env = _job_env(probe_dir, [out_dir, ckpt_dir], crash=None)
        full, smaller, _ = plan.sizes
        workers = dict(zip("ABC", plan.nodes))
        env.update(DDP_COURSE_PROBE_LEAVE=f"B:{plan.leave_step}:{full}",
                   DDP_COURSE_PROBE_HOLD=f"{smaller}:{plan.hold_steps}",
                   DDP_COURSE_PROBE_INPUT_FEATURES=str(input_features), DDP_COURSE_PROBE_GATE="1")
        port, run_id = _free_port(), uuid.uuid4().hex[:12]
        logs: list = []
        procs: dict[str, subprocess.Popen] = {}

        def agent(name: str) -> None:
            cmd = [*AGENT, "--monitor-interval=0.1", "--nnodes=1:2",
                   f"--nproc_per_node={workers[name]}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1",
                   f"--rdzv-conf={RDZV_CONF},is_host={int(name == 'A')}", "--max-restarts=3",
                   f"--log-dir={job}/logs{name}", PROBE_SCRIPT, script, "--out", out_dir, "--ckpt", ckpt_path]
            logs.append(open(os.path.join(job, f"agent{name}.log"), "wb"))  # noqa: SIM115 - closed below
            procs[name] = agents.start(cmd, cwd=job, env={**env, "DDP_COURSE_PROBE_NODE": name}, stdout=logs[-1])

        gates = _Gates(probe_dir, ckpt_path, on_round)
        watch = FolderWatch([ckpt_dir])  # the kernel's account of CKPT's folder, from this process, before any worker
        started = time.monotonic()
        timed_out = idle = False
        try:
            agent("A")
            agent("B")
            deadline = started + ELASTIC_TIMEOUT
            busy = None  # the last moment an agent had a worker (None: none yet, the agents are starting)
            while time.monotonic() < deadline and procs["A"].poll() is None:
                time.sleep(0.05)
                gates.tick()
                if "C" not in procs and _held(probe_dir):
                    agent("C")
                if _working(list(procs.values())):
                    busy = time.monotonic()
                elif busy is not None and time.monotonic() - busy > STRANDED_AFTER:
                    idle = True
                    break  # no worker left anywhere, and none started again: the agents only wait for each other
            last = min(deadline, time.monotonic() + 20)  # C's agent ends once A's has
            while not idle and "C" in procs and procs["C"].poll() is None and time.monotonic() < last:
                time.sleep(0.1)
            timed_out = not idle and procs["A"].poll() is None
        finally:
            _stop(list(procs.values()), dump_stacks=timed_out)
            for fh in logs:
                fh.close()
            files = watch.stop()
        gates.notes.append((None, gates.note(False)))
        run = Run(
            scenario="elastic",  # type: ignore[arg-type]
            crash=None,
            layout=(workers["A"], workers["B"]),  # the agents that start the job (C joins later)
            command=plan.describe(),
            returncodes=[procs["A"].returncode] + ([procs["C"].returncode] if "C" in procs else []),
            timed_out=timed_out,
            timeout=ELASTIC_TIMEOUT,
            elapsed=time.monotonic() - started,
            log="\n".join(f"--- agent {n} ---\n" + _read(os.path.join(job, f"agent{n}.log")) for n in procs),
            out_dir=out_dir,
            ckpt_path=ckpt_path,
            round_notes=gates.notes,
            files=files,
            files_problem=watch.problem,
        )
        _observe(run, probe_dir)
        return run
    finally:
        shutil.rmtree(job, ignore_errors=True)
