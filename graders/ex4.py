"""Checks for exercise 4: a training script launched with torchrun.

Every check launches the student's script with real torchrun (``python -m
torch.distributed.run``) through :mod:`graders.torchrun_probe`, which records
what each worker really did (its environment, checkpoint writes and renames,
optimizer steps, ``destroy_process_group``). A launch costs several seconds, so
a script is launched at most twice and every check reads those two runs
(cached by the script's content):

* ``nodes``: two torchrun agents on this machine joined by a c10d rendezvous
  (``--nnodes=2``, 1 and 2 workers: world size 3, and LOCAL_RANK != RANK on
  the second node), uninterrupted;
* ``restart``: ``--standalone --nproc_per_node=2 --max-restarts=1``; the worker
  of rank 1 dies once, right after its 5th optimizer step (in epoch 2 of 0-3), so
  the job ends right only if the script resumes from its last checkpoint.

GPUs are hidden from the job (it trains on gloo everywhere), and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` works around pytorch#135712 (a
restarted ``--standalone`` job failing in "Gloo connectFullMesh").
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from graders import harness
from graders.core import CheckFailed, expect, passed

# The script's given parts (the notebook's train.py): tests keep the two in step.
EPOCHS = 4
STEPS_PER_EPOCH = 2
LR = 0.05
MOMENTUM = 0.9

CRASH_RANK = 1
CRASH_STEP = 5  # rank 1's 5th optimizer step: epochs 0 and 1 are checkpointed, epoch 2 has begun
NODES_WORKERS = (1, 2)  # workers per torchrun agent in the 2-node run
NODES_TIMEOUT = 180.0
RESTART_TIMEOUT = 240.0
ATOL = 1e-6

PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_probe.py")
_STUDENT_FRAME_SKIP = ("torchrun_probe.py", "<frozen runpy>")


def make_model() -> nn.Module:
    """The tiny model: the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def get_batch(rank: int, epoch: int, step: int):
    """This rank's batch for (epoch, step): different on every rank and in every epoch."""
    g = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
    x = torch.randn(8, 4, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


@functools.cache
def expected_weights(world_size: int, ranks: tuple[int, ...] | None = None) -> dict:
    """Final weights of an uninterrupted DDP run on ``world_size`` ranks, computed in one process.

    DDP averages the ranks' gradients, which (equal batch sizes) is one process
    training on all ranks' batches at once. ``ranks`` restricts the data to
    those ranks (``(0,)``: what rank 0 computes when gradients are not averaged).
    """
    ranks = tuple(range(world_size)) if ranks is None else ranks
    model = make_model()
    params = list(model.parameters())
    momentum = [None] * len(params)
    for epoch in range(EPOCHS):
        for step in range(STEPS_PER_EPOCH):
            batches = [get_batch(rank, epoch, step) for rank in ranks]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
            with torch.no_grad():  # torch.optim.SGD's update, written out (importing torch.optim costs seconds)
                for i, (p, g) in enumerate(zip(params, grads)):
                    momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul_(MOMENTUM).add_(g)
                    p.sub_(LR * momentum[i])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- running torchrun


@dataclass
class Worker:
    """One worker process of a torchrun job, as the probe saw it."""

    pid: int
    rank: int
    local_rank: int
    world_size: int
    group_rank: int
    attempt: int
    events: list[dict]
    output: str = ""
    stack: str = ""

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def exited(self) -> bool:
        return bool(self.of("exit")) or bool(self.of("crash"))

    @property
    def name(self) -> str:
        return f"rank {self.rank} (LOCAL_RANK {self.local_rank}, node {self.group_rank}, attempt {self.attempt})"


@dataclass
class Run:
    """What one torchrun launch of the script did."""

    scenario: str
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

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def attempt(self, n: int) -> list[Worker]:
        return sorted((w for w in self.workers if w.attempt == n), key=lambda w: w.rank)

    @property
    def attempts(self) -> int:
        return 1 + max((w.attempt for w in self.workers), default=0)


_CACHE: dict[tuple, Run] = {}


def _script(check: str, script: str) -> tuple[str, str]:
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise CheckFailed(
            check,
            f"there is no training script at {path}",
            hint="run the %%writefile cell that writes train.py first",
        )
    with open(path, "rb") as fh:
        content = fh.read()
    _require_written(check, path, content.decode("utf-8", "replace"))
    return path, hashlib.sha256(content).hexdigest()


def _require_written(check: str, path: str, source: str) -> None:
    """Fail at once, without a launch, for a script that cannot run: a syntax error, or main() still a stub."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        raise CheckFailed(check, f"train.py does not compile: {err.msg} (line {err.lineno})",
                          hint="fix the syntax error in the %%writefile cell and run it again",
                          detail=(err.text or "").rstrip()) from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            for stmt in node.body:
                exc = stmt.exc if isinstance(stmt, ast.Raise) else None
                name = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(name, ast.Name) and name.id == "NotImplementedError":
                    raise CheckFailed(check, "train.py is not written yet: main() still raises NotImplementedError",
                                      hint="write main() in the %%writefile cell (replace `raise "
                                      "NotImplementedError()`), run that cell, then this one")


def run_script(script: str, scenario: str, check: str = "torchrun") -> Run:
    """Launch ``script`` for ``scenario`` ("nodes" or "restart"), or reuse the run of the same content."""
    path, digest = _script(check, script)
    key = (path, digest, scenario)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _launch(path, scenario)
    return _CACHE[key]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_env(probe_dir: str, watched: list[str], crash: bool) -> dict:
    env = dict(os.environ)
    for name in [k for k in env if k.startswith(("TORCHELASTIC_", "DDP_COURSE_PROBE_"))]:
        del env[name]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        DDP_COURSE_PROBE_DIR=probe_dir,
        DDP_COURSE_PROBE_WATCH=os.pathsep.join(watched),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # pytorch#135712: restarts fail in Gloo connectFullMesh
        CUDA_VISIBLE_DEVICES="",  # grade on gloo/CPU everywhere, deterministically
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in [n for _, n in socket.if_nameindex()]:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # all workers are on this host; hostname lookup is flaky in containers
    if crash:
        env["DDP_COURSE_PROBE_CRASH_RANK"] = str(CRASH_RANK)
        env["DDP_COURSE_PROBE_CRASH_STEP"] = str(CRASH_STEP)
    return env


_DESCRIPTIONS = {
    "restart": "the restart run (torchrun --standalone --nproc_per_node=2 --max-restarts=1 train.py)",
    "nodes": "the 2-node run (two torchrun agents, --nnodes=2, c10d rendezvous, 1 + 2 workers)",
}


def _commands(scenario: str, job: str, tail: list[str]) -> list[list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1"]
    if scenario == "restart":
        return [torchrun + ["--standalone", "--nproc_per_node=2", "--max-restarts=1",
                            f"--log-dir={job}/logs0"] + tail]
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    return [
        torchrun + ["--nnodes=2", f"--nproc_per_node={n}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1",
                    "--max-restarts=0", f"--log-dir={job}/logs{i}"] + tail
        for i, n in enumerate(NODES_WORKERS)
    ]


def _launch(script: str, scenario: str) -> Run:
    job = tempfile.mkdtemp(prefix=f"ddp-course-ex4-{scenario}-")
    try:
        out_dir, ckpt_dir, probe_dir = (os.path.join(job, d) for d in ("out", "ckpt", "probe"))
        for d in (out_dir, ckpt_dir, probe_dir):
            os.makedirs(d)
        ckpt_path = os.path.join(ckpt_dir, "ckpt.pt")
        env = _job_env(probe_dir, [out_dir, ckpt_dir], crash=scenario == "restart")
        tail = [PROBE_SCRIPT, script, "--out", out_dir, "--ckpt", ckpt_path]
        commands = _commands(scenario, job, tail)
        timeout = RESTART_TIMEOUT if scenario == "restart" else NODES_TIMEOUT
        started = time.monotonic()
        logs, procs = [], []
        for i, cmd in enumerate(commands):
            logs.append(open(os.path.join(job, f"agent{i}.log"), "wb"))  # noqa: SIM115 - closed below
            procs.append(subprocess.Popen(cmd, cwd=job, env=env, stdin=subprocess.DEVNULL, stdout=logs[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        timed_out = False
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _stop(procs, dump_stacks=timed_out)
            for fh in logs:
                fh.close()
        elapsed = time.monotonic() - started
        run = Run(
            scenario=scenario,
            command=_DESCRIPTIONS[scenario],
            returncodes=[p.returncode for p in procs],
            timed_out=timed_out,
            timeout=timeout,
            elapsed=elapsed,
            log="\n".join(_read(os.path.join(job, f"agent{i}.log")) for i in range(len(procs))),
            out_dir=out_dir,
            ckpt_path=ckpt_path,
        )
        _observe(run, probe_dir)
        return run
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _stop(procs: list[subprocess.Popen], dump_stacks: bool) -> None:
    """End every agent and worker of the job (workers run in sessions of their own)."""
    import psutil

    victims = []
    for proc in procs:
        try:
            victims += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
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
            group_rank=num("GROUP_RANK"), attempt=max(num("TORCHELASTIC_RESTART_COUNT"), 0), events=events,
            output=_read(os.path.join(probe_dir, f"output-{pid}.log")),
            stack=_read(os.path.join(probe_dir, f"stack-{pid}.txt")),
        ))
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
            run.final = {k.removeprefix("module."): v for k, v in state.items()}
        except Exception as exc:  # noqa: BLE001 - reported to the student
            run.final = f"{type(exc).__name__}: {exc}"
    run.ckpt_exists = os.path.exists(run.ckpt_path)


# --------------------------------------------------------------------------- explaining a failed run


def _student_traceback(text: str) -> str:
    """The last traceback in ``text`` without the probe's and runpy's frames."""
    text = _unprefix(text)  # torch prefixes its workers' stderr lines
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return ""
    lines, kept, skipping = text[start:].splitlines(), [], False
    for line in lines[:80]:
        if line.startswith('  File "'):
            skipping = any(s in line for s in _STUDENT_FRAME_SKIP)
        elif not line.startswith(" "):
            skipping = False
        if not skipping:
            kept.append(line)
        if kept and not line.startswith(" ") and line != lines[0] and not line.startswith("Traceback"):
            break
    return "\n".join(kept)


def _unprefix(text: str) -> str:
    """Drop the "[rank0]: " torch puts in front of its workers' stderr lines."""
    return re.sub(r"(?m)^\[(?:default)?rank\d+\]: ?", "", text)


def _tail(text: str, n: int = 12) -> str:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def _failure(check: str, run: Run, context: str = "") -> CheckFailed:
    """A CheckFailed that says why ``run`` did not finish: who crashed or hung, with their own output."""
    what = run.command
    if not run.workers:
        return CheckFailed(
            check, f"{context}{what} started no worker", hint="run the same command in a terminal to see why",
            detail=_tail(run.log, 20),
        )
    last = run.attempt(run.attempts - 1)
    if run.timed_out:
        stuck = [w for w in last if not w.exited]
        detail = "\n".join(
            f"{w.name} was at:\n{_student_stack(w.stack) or _tail(w.output, 8)}" for w in stuck
        )
        if not stuck:  # the workers ended, the agents did not: a worker died and its agent hung waiting
            return CheckFailed(
                check,
                f"{context}{what} did not finish within {run.timeout:g} s: every worker had ended, "
                "but torchrun did not (a worker was killed or crashed; see torchrun's report below)",
                hint="run the same command in a terminal; if a worker was killed by a signal (SIGABRT, SIGKILL), "
                "look for an error it printed just before, or for a machine out of memory",
                detail=_tail(run.log, 20),
            )
        return CheckFailed(
            check,
            f"{context}{what} did not finish within {run.timeout:g} s; "
            f"{_were([w.rank for w in stuck])} still running (stuck)",
            ranks=[w.rank for w in stuck],
            hint="a rank that waits forever is usually in a collective (all_reduce, barrier, DDP backward) "
            "another rank never reached, e.g. a collective inside `if rank == 0:`, or an init_process_group "
            "given a wrong rank or world_size; let init_process_group read them from the environment",
            detail=detail or _tail(run.log, 20),
        )
    # the last attempt's failures first: in the restart run, attempt 0 fails by design
    crashed = sorted((w for w in run.workers if "Traceback (most recent call last)" in w.output and not w.of("crash")),
                     key=lambda w: (-w.attempt, w.rank))
    failed = crashed[0] if crashed else None
    if failed is not None:
        tb = _student_traceback(failed.output)
        message = tb.splitlines()[-1] if tb else "an error"
        others = sorted({w.rank for w in crashed[1:] if w.attempt == failed.attempt})
        also = f" ({_ranks(others)} failed too)" if others else ""
        return CheckFailed(
            check,
            f"{context}{what} failed: {failed.name} raised {message}{also}",
            ranks=[failed.rank],
            hint=_hint_for(message) or "read the traceback below (it starts in your script)",
            detail=tb,
        )
    talked = [w for w in last if _unprefix(w.output).strip()]
    detail = "\n".join(f"{w.name} printed:\n{_tail(_unprefix(w.output), 8)}" for w in talked[:2])
    return CheckFailed(
        check,
        f"{context}{what} failed (exit codes {run.returncodes}) without a Python traceback",
        ranks=[w.rank for w in talked],
        hint=_hint_for(detail) or "read each rank's last output below; run the script with torchrun in a terminal "
        "to see all of it",
        detail=detail or _tail(run.log, 20),
    )


def _hint_for(message: str) -> str | None:
    if "NotImplementedError" in message:
        return "write train.py first: the answer parts of the %%writefile cell still raise NotImplementedError"
    if re.search(r"--local[-_]rank", message):
        return "torchrun passes no --local_rank argument: read int(os.environ['LOCAL_RANK']) instead"
    if "unrecognized arguments" in message or "arguments are required" in message:
        return "the grader runs `train.py --out OUT --ckpt CKPT`: keep the given argument parser as it is"
    if re.search(r"KeyError: '(RANK|LOCAL_RANK|WORLD_SIZE)'", message):
        return "torchrun sets RANK, LOCAL_RANK and WORLD_SIZE: read them with os.environ"
    if "Connection" in message or "Timed out" in message:
        return ("this rank lost a peer while in a collective: another rank crashed or skipped the collective "
                "(every rank must call the same collectives in the same order)")
    return None


def _student_stack(stack: str) -> str:
    lines = [line for line in stack.splitlines() if not any(s in line for s in _STUDENT_FRAME_SKIP)]
    return "\n".join(lines[:12])


def _ranks(ranks) -> str:
    return harness.rank_list(ranks) if ranks else ""


def _were(ranks) -> str:
    text = _ranks(ranks)
    return text and text + (" was" if len(set(ranks)) == 1 else " were")


def _require_ok(check: str, run: Run, context: str = "") -> None:
    if not run.ok:
        raise _failure(check, run, context)


# --------------------------------------------------------------------------- the checks


def _check_reports(check: str, run: Run, world_size: int) -> None:
    """Every worker reported the rank, local_rank and world_size torchrun gave it."""
    if not run.workers:
        raise _failure(check, run)
    mistakes, missing = [], []
    last = run.attempts - 1
    for w in run.workers:
        if w.of("crash"):
            continue
        report = run.reports.get(w.pid)
        if report is None:
            if w.attempt == last:  # workers of an attempt that torchrun stopped may not have got that far
                missing.append(w)
            continue
        if not isinstance(report, dict):
            mistakes.append((w, f"its report is {report}", None))
            continue
        for key, real in (("rank", w.rank), ("local_rank", w.local_rank), ("world_size", w.world_size)):
            got = report.get(key)
            if got != real or isinstance(got, bool):
                mistakes.append((w, f"{key}={got!r}, but torchrun set {key.upper()}={real}", _report_hint(key, got, w)))
    if missing and not mistakes:
        if not run.ok and any(not run.reports.get(w.pid) for w in missing):
            raise _failure(check, run, "no report from " + _ranks([w.rank for w in missing]) + ": ")
        raise CheckFailed(
            check,
            f"{_ranks([w.rank for w in missing])} wrote no report",
            ranks=[w.rank for w in missing],
            hint="call report(args.out, rank, local_rank, world_size) on every rank, early in main()",
        )
    if mistakes:
        first = mistakes[0]
        raise CheckFailed(
            check,
            f"{first[0].name} reported {first[1]}",
            ranks=[w.rank for w, _, _ in mistakes],
            expected=f"rank, local_rank, world_size = RANK, LOCAL_RANK, WORLD_SIZE from torchrun's environment "
            f"(world size {world_size})",
            got="; ".join(f"rank {w.rank}: {what}" for w, what, _ in mistakes[:4]),
            hint=first[2] or "read all three from os.environ: torchrun sets them for every worker",
        )


def _report_hint(key: str, got, w: Worker) -> str | None:
    if key == "local_rank" and got == w.rank and w.rank != w.local_rank:
        return ("you used RANK as the local rank: RANK is global (0..WORLD_SIZE-1 across all machines), "
                "LOCAL_RANK is the index on this machine (the one to pick a GPU with): "
                "local_rank = int(os.environ['LOCAL_RANK'])")
    if key == "rank" and got == w.local_rank and w.rank != w.local_rank:
        return ("you used LOCAL_RANK as the global rank: on a second machine LOCAL_RANK starts at 0 again; "
                "rank = int(os.environ['RANK'])")
    if key == "local_rank" and got in (0, -1, None):
        return ("torchrun passes no --local_rank argument (an argparse default of 0 is wrong on every other "
                "worker): local_rank = int(os.environ['LOCAL_RANK'])")
    if key == "world_size":
        return "world_size = int(os.environ['WORLD_SIZE']): never hard-code it"
    return None


def check_standalone_ranks(script: str = "train.py") -> None:
    """Under ``torchrun --standalone --nproc_per_node=2`` every worker reads its rank, local rank and world size."""
    check = "check_standalone_ranks"
    _check_reports(check, run_script(script, "restart", check), world_size=2)
    passed(check)


def check_multinode_ranks(script: str = "train.py") -> None:
    """Two torchrun agents (2 "nodes", world size 3): LOCAL_RANK and RANK differ on the second node."""
    check = "check_multinode_ranks"
    run = run_script(script, "nodes", check)
    _check_reports(check, run, world_size=sum(NODES_WORKERS))
    passed(check)


def _writes(w: Worker, run: Run) -> list[str]:
    """What a worker wrote that only rank 0 may write: checkpoint saves, renames and raw writes, and final.pt."""
    final = os.path.join(run.out_dir, "final.pt")
    ckpt_dir = os.path.dirname(run.ckpt_path) + os.sep
    found = []
    for e in w.events:
        path = e.get("path") or ""
        if e["event"] == "save" and (path == final or not path.startswith(run.out_dir + os.sep)):
            found.append(f"torch.save(..., {os.path.basename(path)!r})")
        elif e["event"] == "rename" and (e.get("dst") or "") in (run.ckpt_path, final):
            found.append(f"os.replace({os.path.basename(e.get('src') or '?')!r}, {os.path.basename(e['dst'])!r})")
        elif e["event"] == "open" and e.get("write") and (path.startswith(ckpt_dir) or path == final):
            found.append(f"open({os.path.basename(path)!r}) for writing")
    return found


def _commits(w: Worker, run: Run) -> list[dict]:
    """The moments the checkpoint file was (re)placed: a rename onto it, or a save straight into it."""
    return [e for e in w.events
            if (e["event"] == "rename" and e.get("dst") == run.ckpt_path)
            or (e["event"] == "save" and e.get("path") == run.ckpt_path)]


def check_checkpoint_rank0(script: str = "train.py") -> None:
    """Only rank 0 writes the checkpoint (after every epoch) and the final weights."""
    check = "check_checkpoint_rank0"
    run = run_script(script, "nodes", check)
    others = {w.rank: _writes(w, run) for w in run.workers if w.rank != 0}
    others = {r: found for r, found in others.items() if found}
    if others:
        rank, found = sorted(others.items())[0]
        only_final = all("'final.pt'" in f for writes in others.values() for f in writes)
        raise CheckFailed(
            check,
            f"{_ranks(others)} wrote {'the final weights' if only_final else 'the checkpoint'} too "
            f"(rank {rank}: {', '.join(found[:3])})",
            ranks=list(others),
            expected="only rank 0 writes the checkpoint and final.pt: every rank holds the same weights, and "
            "several writers race on the same file (a reader can get a half-written one)",
            hint="guard every save with `if rank == 0:` (keep collectives such as barrier() outside the guard)",
        )
    _require_ok(check, run)
    rank0 = [w for w in run.workers if w.rank == 0]
    commits = _commits(rank0[0], run) if rank0 else []
    expect(
        len(commits) >= EPOCHS and run.ckpt_exists,
        check,
        f"rank 0 wrote the checkpoint {len(commits)} time(s) in {EPOCHS} epochs"
        + ("" if run.ckpt_exists else ", and there is no file at --ckpt at the end"),
        ranks=[0],
        expected=f"a checkpoint at the path given by --ckpt after every epoch (at least {EPOCHS} writes)",
        hint="call save_checkpoint(state, args.ckpt) at the end of each epoch, on rank 0",
    )
    passed(check)


def check_atomic_checkpoint(script: str = "train.py") -> None:
    """The checkpoint is written to a temporary file in the same folder and moved into place with os.replace."""
    check = "check_atomic_checkpoint"
    run = run_script(script, "nodes", check)
    name = os.path.basename(run.ckpt_path)
    hint = ("write to a temporary file next to it, then move it into place in one step: "
            "tmp = ckpt_path + '.tmp'; torch.save(state, tmp); os.replace(tmp, ckpt_path)")
    writers = [w for w in run.workers if w.rank == 0] or run.workers
    direct = [e for w in writers for e in w.events
              if (e["event"] == "save" and e.get("path") == run.ckpt_path)
              or (e["event"] == "open" and e.get("write") and e.get("path") == run.ckpt_path)]
    expect(
        not direct,
        check,
        f"rank 0 wrote the checkpoint in place ({'torch.save' if direct and direct[0]['event'] == 'save' else 'open'}"
        f" straight into {name!r}): a crash or kill during that write leaves a truncated checkpoint, "
        "and the restart cannot load it",
        ranks=[0],
        hint=hint,
    )
    renames = [e for w in writers for e in w.events if e["event"] == "rename" and e.get("dst") == run.ckpt_path]
    if not renames:
        if not run.ok:
            raise _failure(check, run, "no checkpoint was written: ")
        raise CheckFailed(check, f"rank 0 never moved a finished file into {name!r} with os.replace",
                          ranks=[0], hint=hint)
    far = [e for e in renames if os.path.dirname(e.get("src") or "") != os.path.dirname(run.ckpt_path)]
    expect(
        not far,
        check,
        f"the temporary file {far[0]['src'] if far else ''} is not in the checkpoint's folder: os.replace is "
        "atomic only within one file system (across file systems it fails or copies)",
        ranks=[0],
        hint="put the temporary file next to the checkpoint: tmp = ckpt_path + '.tmp'",
    )
    passed(check)


def _compare(final: dict, reference: dict) -> float | None:
    """Max abs difference to ``reference``; None if the keys or shapes differ."""
    if set(final) != set(reference) or any(final[k].shape != reference[k].shape for k in reference):
        return None
    return max(float((final[k].float() - reference[k]).abs().max()) for k in reference)


def _final_weights(check: str, run: Run) -> dict:
    if run.final is None:
        raise CheckFailed(check, "rank 0 did not write the final weights to OUT/final.pt", ranks=[0],
                          hint="at the end, on rank 0: torch.save(model.state_dict(), os.path.join(args.out, 'final.pt'))")
    if isinstance(run.final, str):
        raise CheckFailed(check, f"OUT/final.pt does not load as a state_dict: {run.final}", ranks=[0],
                          hint="save model.state_dict() (a dict of tensors), not the model object")
    return run.final


def check_ddp_training(script: str = "train.py") -> None:
    """The final weights of the uninterrupted 3-rank run equal one process training on all ranks' batches."""
    check = "check_ddp_training"
    run = run_script(script, "nodes", check)
    _require_ok(check, run)
    final = _final_weights(check, run)
    world_size = sum(NODES_WORKERS)
    reference = expected_weights(world_size)
    diff = _compare(final, reference)
    if diff is None:
        raise CheckFailed(check, "final.pt does not hold this model's weights",
                          expected=sorted(reference), got=sorted(final), ranks=[0],
                          hint="save the model's state_dict (model.state_dict(), or ddp_model.module.state_dict())")
    if diff > ATOL:
        alone = _compare(final, expected_weights(world_size, (0,)))
        hint = ("rank 0's weights are what rank 0 learns from its own batches alone: the gradients were never "
                "averaged. Wrap the model in DDP and call backward through ddp_model"
                if alone is not None and alone <= ATOL else
                "train as the given code does: DDP(model), SGD(lr=LR, momentum=MOMENTUM), get_batch(rank, "
                "epoch, step) for every epoch and step, mse_loss, and no change to the given functions")
        raise CheckFailed(
            check,
            f"rank 0's final weights differ from an uninterrupted {world_size}-rank DDP run (max |diff| {diff:.3g})",
            ranks=[0], expected=f"equal within {ATOL:g}", got=f"max |diff| = {diff:.3g}", hint=hint,
        )
    passed(check)


def check_restart_resume(script: str = "train.py") -> None:
    """Rank 1 dies once mid-training; with --max-restarts=1 the job resumes from the checkpoint and ends right."""
    check = "check_restart_resume"
    run = run_script(script, "restart", check)
    context = (f"rank {CRASH_RANK} was killed after its optimizer step {CRASH_STEP}, in epoch "
               f"{(CRASH_STEP - 1) // STEPS_PER_EPOCH} (epochs 0-{EPOCHS - 1}); ")
    crashed = any(w.of("crash") for w in run.workers)
    if not crashed:
        if not run.ok:
            raise _failure(check, run, "before the injected crash: ")
        steps = max((len(w.of("step")) for w in run.attempt(0) if w.rank == CRASH_RANK), default=0)
        raise CheckFailed(
            check,
            f"the grader could not crash rank {CRASH_RANK}: it took only {steps} optimizer step(s), and the crash "
            f"comes after step {CRASH_STEP} of {EPOCHS * STEPS_PER_EPOCH}",
            ranks=[CRASH_RANK],
            hint=f"every rank trains all {EPOCHS} epochs of {STEPS_PER_EPOCH} steps, in step with the others (DDP), "
            "calling optimizer.step() of a torch.optim optimizer once per step",
        )
    if not run.ok:
        raise _failure(check, run, context + "after the restart, ")
    restarted = run.attempt(1)
    expect(bool(restarted), check, context + "torchrun never restarted the workers",
           hint="the grader runs torchrun with --max-restarts=1; the job must not end before that")
    total = EPOCHS * STEPS_PER_EPOCH
    crash_epoch = (CRASH_STEP - 1) // STEPS_PER_EPOCH
    resumed_steps = (EPOCHS - crash_epoch) * STEPS_PER_EPOCH
    for w in restarted:
        steps = len(w.of("step"))
        loaded = any(e.get("path") == run.ckpt_path for e in w.of("load") + w.of("open"))
        if steps >= total or not loaded:
            raise CheckFailed(
                check,
                context + f"after the restart {w.name} "
                + ("never read the checkpoint and " if not loaded else "")
                + f"trained {steps} steps: it started from epoch 0 again",
                ranks=[w.rank],
                expected=f"load the checkpoint of epoch {crash_epoch - 1} and train only epochs "
                f"{crash_epoch}..{EPOCHS - 1} "
                f"({resumed_steps} steps)",
                got=f"{steps} steps",
                hint="at start-up, if os.path.exists(args.ckpt): load it (map_location='cpu') on every rank, "
                "restore the model and optimizer state, and start at the saved epoch + 1",
            )
    final = _final_weights(check, run)
    reference = expected_weights(2)
    diff = _compare(final, reference)
    if diff is None or diff > ATOL:
        steps = len(restarted[0].of("step")) if restarted else 0
        if steps != resumed_steps:
            hint = (f"after the restart rank 0 trained {steps} steps, not {resumed_steps}: resume at the epoch after "
                    "the one saved in the checkpoint (off by one?)")
        else:
            hint = ("the resumed run took the right number of steps but ended elsewhere: restore the optimizer "
                    "state too (SGD momentum lives there), on every rank, and save the state after the epoch's "
                    "last step")
        raise CheckFailed(
            check,
            context + "the final weights differ from an uninterrupted 2-rank run "
            + (f"(max |diff| {diff:.3g})" if diff is not None else "(different keys or shapes)"),
            ranks=[0],
            expected=f"equal within {ATOL:g} (check_ddp_training compares the uninterrupted run; fix that first if it fails)",
            got=f"max |diff| = {diff:.3g}" if diff is not None else sorted(final),
            hint=hint,
        )
    passed(check)


def check_destroy(script: str = "train.py") -> None:
    """Every worker calls dist.destroy_process_group() before it exits."""
    check = "check_destroy"
    run = run_script(script, "nodes", check)
    _require_ok(check, run)
    missing = [w.rank for w in run.workers if not w.of("destroy")]
    expect(
        not missing,
        check,
        f"{_ranks(missing)} never called dist.destroy_process_group()",
        ranks=missing,
        hint="end main() with dist.destroy_process_group() on every rank: it releases the process group's "
        "sockets and threads (and, with NCCL, avoids warnings and hangs at exit)",
    )
    passed(check)
