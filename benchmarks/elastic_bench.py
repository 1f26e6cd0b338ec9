"""How long torch's elastic agent takes here to shrink a job when a node leaves and to grow it when one joins.

    python benchmarks/elastic_bench.py [--repeat 3] [--last-call 2] [--keep-alive 1x4]

Three torchrun agents on this machine share one c10d rendezvous on 127.0.0.1 (``--nnodes=1:2``):
node A (2 workers, hosts the rendezvous) and node B (1 worker) start together (world size 3); B's
worker kills its own agent after a few steps and exits, as a machine that dies; A's workers fail, A
meets the rendezvous again and goes on alone (world size 2); once they run, node C (1 worker) starts
and A restarts its workers at world size 3 again. Every worker logs a timestamped line per step to a
file of its own, and the table gives, per run:

* ``start``: from launching the agents to the first step of the 3-rank job;
* ``shrink``: from B's departure to the first step of the 2-rank job;
* ``grow``: from launching C to the first step of the grown 3-rank job;
* ``total``: the whole run, agents' exit included.

``--last-call`` and ``--keep-alive INTERVALxATTEMPTS`` go to ``--rdzv-conf``: a lost node is dropped
once its heartbeats have been missing for INTERVAL x ATTEMPTS seconds (torch's default 5x3), and a round
with fewer than the maximum of nodes completes ``last_call_timeout`` seconds (default 30) after the
minimum is reached. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set: with the agent's shared store a
grown job waits for MASTER_ADDR until a DistStoreError (pytorch#135712's store, measured here).
Timings on a shared 2-core machine are noisy: take the median, and rerun under load before relying on one.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

WORKER = r'''
import os, signal, sys, time
import torch, torch.distributed as dist

out, leave_after = sys.argv[1], int(sys.argv[2])
env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
log = open(os.path.join(out, f"steps-{os.getpid()}.txt"), "w")
dist.init_process_group("gloo")
for step in range(400):
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"{time.time():.3f} {env['WORLD_SIZE']} {env['TORCHELASTIC_RESTART_COUNT']} {step}", file=log, flush=True)
    if leave_after >= 0 and step == leave_after and env["TORCHELASTIC_RESTART_COUNT"] == 0:
        print(f"{time.time():.3f} left", file=log, flush=True)
        os.kill(os.getppid(), signal.SIGKILL)  # the node's agent dies first, then its worker
        os._exit(1)
    if os.path.exists(os.path.join(out, "stop")) and env["WORLD_SIZE"] == 3 and step > 5:
        break
    time.sleep(0.05)
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def steps(out: str) -> list[tuple[float, int, int]]:
    """(time, world size, restart count) of every step any worker logged, in time order."""
    found = []
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 4:
                    found.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return sorted(found)


def left_at(out: str) -> float | None:
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        with open(path) as fh:
            for line in fh:
                if line.endswith(" left\n"):
                    return float(line.split()[0])
    return None


def first(found, after: float, world_size: int) -> float | None:
    return next((t for t, ws, _ in found if t > after and ws == world_size), None)


def one_run(args) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="ddp-course-elastic-")
    script = os.path.join(work, "worker.py")
    with open(script, "w") as fh:
        fh.write(WORKER)
    interval, attempts = args.keep_alive.split("x")
    conf = f"last_call_timeout={args.last_call},keep_alive_interval={interval},keep_alive_max_attempt={attempts}"
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={uuid.uuid4().hex[:8]}",
              "--local-addr=127.0.0.1", "--max-restarts=3", "--monitor-interval=0.1"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}

    def agent(nproc: int, host: bool, leave_after: int) -> subprocess.Popen:
        cmd = common + [f"--nproc_per_node={nproc}", f"--rdzv-conf={conf},is_host={int(host)}",
                        script, work, str(leave_after)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    started = time.time()
    a = agent(2, True, -1)
    b = agent(1, False, args.leave_after)
    agents, c, grow_from = [a, b], None, None
    deadline = started + args.timeout
    try:
        while time.time() < deadline and a.poll() is None:
            time.sleep(0.1)
            if c is None and left_at(work) and first(steps(work), left_at(work), 2):
                grow_from = time.time()
                c = agent(1, False, -1)
                agents.append(c)
            if c is not None and first(steps(work), grow_from, 3):
                open(os.path.join(work, "stop"), "w").close()
        a.wait(timeout=max(1.0, deadline - time.time()))
        if c is not None:
            c.wait(timeout=30)
    finally:
        for proc in agents:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    total = time.time() - started
    found, left = steps(work), left_at(work)
    result = {"start": (first(found, started, 3) or float("nan")) - started, "total": total}
    result["shrink"] = (first(found, left, 2) or float("nan")) - left if left else float("nan")
    result["grow"] = (first(found, grow_from, 3) or float("nan")) - grow_from if grow_from else float("nan")
    subprocess.run(["rm", "-rf", work], check=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--last-call", type=int, default=2, help="seconds (torch reads it as an integer)")
    parser.add_argument("--keep-alive", default="1x4", help="INTERVALxATTEMPTS seconds, e.g. 5x3 (torch's default)")
    parser.add_argument("--leave-after", type=int, default=20, help="the step after which node B leaves")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    rows = [one_run(args) for _ in range(args.repeat)]
    keys = ("start", "shrink", "grow", "total")
    print(f"last_call_timeout={args.last_call:g}, keep-alive {args.keep_alive}; seconds per run")
    print("run    " + "".join(f"{k:>9}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:<7}" + "".join(f"{row[k]:9.1f}" for k in keys))
    print("median " + "".join(f"{statistics.median(r[k] for r in rows):9.1f}" for k in keys))


if __name__ == "__main__":
    main()
