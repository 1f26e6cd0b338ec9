"""An elastic torchrun launch: a node leaves the job, later another joins, and the job goes on each time.

How it works: three torchrun agents on this machine share one c10d rendezvous on 127.0.0.1
(``--nnodes=1:2``, ``--max-restarts=3``), each worker running the script through
:mod:`~course.launcher.torchrun.torchrun_probe`:

1. node A (:data:`NODE_WORKERS` ``["A"]`` workers; it hosts the rendezvous store) and node B (1 worker) start
   together: world size 3;
2. B's worker leaves after its :data:`LEAVE_STEP`-th optimizer step (mid-epoch): it SIGKILLs its own agent and
   exits, as a machine that dies. A's workers lose their peer, A meets the rendezvous again and restarts them
   alone: world size 2 (a failure restart: it counts against ``--max-restarts``);
3. the probe holds that 2-worker job before its second optimizer step; seeing it held, the grader starts node
   C (1 worker), and A restarts its workers with C's: world size 3 again (a membership change: it does not
   count against ``--max-restarts``, and C's worker starts with TORCHELASTIC_RESTART_COUNT=0).

The rendezvous settings are those :mod:`benchmarks.elastic_bench` measured here: ``last_call_timeout=2`` (an
integer: "2.0" makes the agent exit at once) and keep-alive 1 s x 4 (1 s x 2 let a joining node form a job of
its own under load). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agent's shared store a grown job waits
for MASTER_ADDR until a DistStoreError. The result is a :class:`~course.launcher.torchrun.runner.Run` of every
worker of every round; the workers of one round share WORLD_SIZE and MASTER_PORT (:func:`rounds`).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

from course.launcher.torchrun.runner import (
    PROBE_SCRIPT,
    STRANDED_AFTER,
    Run,
    Worker,
    _free_port,
    _job_env,
    _observe,
    _read,
    _script,
    _stop,
    _working,
)

NODE_WORKERS = {"A": 2, "B": 1, "C": 1}
LEAVE_STEP = 2  # B leaves after its 2nd optimizer step of the 3-worker job
ELASTIC_TIMEOUT = 150.0
INPUT_FEATURES = 4  # the given model's first layer: the probe logs the rows it receives
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4"
DESCRIPTION = ("the elastic run (three torchrun agents, --nnodes=1:2, c10d rendezvous: nodes A (2 workers) and B "
               "(1) start, B leaves mid-epoch, then node C (1) joins)")

_CACHE: dict[tuple, Run] = {}


def run_elastic(script: str, check: str = "elastic", *, leave_step: int = LEAVE_STEP,
                vet: Callable[[str], None] | None = None) -> Run:
    """Launch ``script`` elastically (see the module doc), or reuse the run of the same content."""
    path, digest = _script(check, script, vet)
    key = (path, digest, int(leave_step))
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _launch(path, int(leave_step))
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


def _launch(script: str, leave_step: int) -> Run:
    job = tempfile.mkdtemp(prefix="ddp-course-ex4-elastic-")
    try:
        out_dir, ckpt_dir, probe_dir = (os.path.join(job, d) for d in ("out", "ckpt", "probe"))
        for d in (out_dir, ckpt_dir, probe_dir):
            os.makedirs(d)
        ckpt_path = os.path.join(ckpt_dir, "ckpt.pt")
        env = _job_env(probe_dir, [out_dir, ckpt_dir], crash=None)
        env.update(DDP_COURSE_PROBE_LEAVE=f"B:{leave_step}", DDP_COURSE_PROBE_HOLD="1",
                   DDP_COURSE_PROBE_INPUT_FEATURES=str(INPUT_FEATURES))
        port, run_id = _free_port(), uuid.uuid4().hex[:12]
        logs: list = []
        procs: dict[str, subprocess.Popen] = {}

        def agent(name: str) -> None:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1", "--nnodes=1:2",
                   f"--nproc_per_node={NODE_WORKERS[name]}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1",
                   f"--rdzv-conf={RDZV_CONF},is_host={int(name == 'A')}", "--max-restarts=3",
                   f"--log-dir={job}/logs{name}", PROBE_SCRIPT, script, "--out", out_dir, "--ckpt", ckpt_path]
            logs.append(open(os.path.join(job, f"agent{name}.log"), "wb"))  # noqa: SIM115 - closed below
            procs[name] = subprocess.Popen(cmd, cwd=job, env={**env, "DDP_COURSE_PROBE_NODE": name},
                                           stdin=subprocess.DEVNULL, stdout=logs[-1], stderr=subprocess.STDOUT,
                                           start_new_session=True)

        started = time.monotonic()
        timed_out = idle = False
        try:
            agent("A")
            agent("B")
            deadline = started + ELASTIC_TIMEOUT
            busy = None  # the last moment an agent had a worker (None: none yet, the agents are starting)
            while time.monotonic() < deadline and procs["A"].poll() is None:
                time.sleep(0.1)
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
        run = Run(
            scenario="elastic",  # type: ignore[arg-type]
            crash=None,
            layout=(NODE_WORKERS["A"], NODE_WORKERS["B"]),  # the agents that start the job (C joins later)
            command=DESCRIPTION,
            returncodes=[procs["A"].returncode] + ([procs["C"].returncode] if "C" in procs else []),
            timed_out=timed_out,
            timeout=ELASTIC_TIMEOUT,
            elapsed=time.monotonic() - started,
            log="\n".join(f"--- agent {n} ---\n" + _read(os.path.join(job, f"agent{n}.log")) for n in procs),
            out_dir=out_dir,
            ckpt_path=ckpt_path,
        )
        _observe(run, probe_dir)
        return run
    finally:
        shutil.rmtree(job, ignore_errors=True)
