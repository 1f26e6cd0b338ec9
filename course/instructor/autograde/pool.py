"""A pool of autograde workers with a deadline per task (a task: one submission to grade).

Each slot holds one :mod:`course.instructor.autograde.worker` process, forked from the
caller, so it starts with nbgrader already imported (a spawned one would spend
~2 s of CPU importing it again, per worker). The caller must have no other
thread when it creates or refills the pool (autograde's progress display is
refreshed from its poll loop for that reason) and hold no open gradebook
connection. A task that passes its deadline, or a worker that dies, costs that
slot its worker: its whole process tree is killed and a fresh worker takes the
next task. A worker that a stop signal killed (:data:`STOP_SIGNALS`: Ctrl-C, SIGTERM,
SIGHUP, sent to it by ``pkill``, a service manager, Slurm's ``scancel``) ends its
task "interrupted": the run was being stopped, the submission did not fail.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from course.instructor.autograde import worker as worker_module

READY_TIMEOUT = 180.0  # a cold start imports nbgrader and torch-free deps; generous on a busy machine


#: how a task ended: "done" (see result), "timeout" (killed at the deadline), "interrupted" (a stop signal
#: killed the worker) or "died" (the worker vanished otherwise)
OutcomeKind = Literal["done", "timeout", "interrupted", "died"]
#: the signals that stop a run (a terminal's Ctrl-C and hang-up, kill's and service managers' SIGTERM): a worker
#: killed by one was stopped from outside, not by what it graded (sandboxed, a submission's code runs as another
#: user and cannot signal its worker); what kills a worker otherwise, SIGKILL included, is "died"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Outcome:
    """How one task ended: nbgrader's result dict, or why there is none."""

    task: Any
    result: dict | None = None
    #: "done" (see result), "timeout" (killed at the deadline), "interrupted" (a stop signal killed the worker)
    #: or "died" (the worker vanished)
    kind: OutcomeKind = "done"
    elapsed: float = 0.0
    detail: str = ""


@dataclass
class _Slot:
    index: int
    process: Any = None
    conn: Any = None
    ready: bool = False
    task: Any = None
    payload: dict = field(default_factory=dict)
    started: float = 0.0
    timeout: float = 0.0
    deadline: float = 0.0


class WorkerPool:
    """Run jobs on ``size`` workers; ``poll()`` returns the jobs that ended."""

    def __init__(self, size: int, course_root: Path, log_dir: Path):
        self.size = size
        self.course_root = str(course_root)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._ctx = multiprocessing.get_context("fork")
        self._slots = [_Slot(i) for i in range(size)]
        #: cores per worker: each submission's kernel, verifier and ranks size their threads to their share
        self.cpus = max(1, (os.cpu_count() or 1) // size)

    def _start(self, slot: _Slot) -> None:
        if threading.active_count() > 1:  # a fork would copy locks other threads may hold
            raise RuntimeError("WorkerPool forks its workers: call it from a process with no other thread")
        parent_conn, child_conn = self._ctx.Pipe()
        log = str(self.log_dir / f"worker-{slot.index}.log")
        slot.process = self._ctx.Process(
            target=worker_module.serve, args=(child_conn, self.course_root, log, os.getpid(), self.cpus),
            name=f"ddp-course-autograde-{slot.index}",
        )
        slot.process.start()
        child_conn.close()
        slot.conn, slot.ready = parent_conn, False

    def _kill(self, slot: _Slot) -> None:
        if slot.process is not None:
            worker_module.kill_tree(slot.process.pid)
            slot.process.join(timeout=5)
        if slot.conn is not None:
            slot.conn.close()
        slot.process = slot.conn = None
        slot.ready = False

    def idle(self) -> list[int]:
        """Slots free for a task."""
        return [s.index for s in self._slots if s.task is None]

    def running(self) -> list[tuple[Any, float]]:
        """(task, seconds running) for every running task."""
        now = time.monotonic()
        return [(s.task, now - s.started) for s in self._slots if s.task is not None]

    def submit(self, index: int, task: Any, payload: dict, timeout: float) -> None:
        """Start ``task`` on slot ``index``; ``payload`` goes to worker.grade; killed after ``timeout`` s."""
        slot = self._slots[index]
        if slot.process is None or not slot.process.is_alive():
            self._kill(slot)
            self._start(slot)
        slot.task, slot.payload, slot.timeout = task, payload, timeout
        slot.started = time.monotonic()
        slot.deadline = slot.started + timeout + (0 if slot.ready else READY_TIMEOUT)
        if slot.ready:
            slot.conn.send(payload)

    def poll(self, wait: float = 0.5) -> list[Outcome]:
        """Wait up to ``wait`` s for workers; return the jobs that finished, timed out or lost their worker."""
        ended: list[Outcome] = []
        busy = {s.conn: s for s in self._slots if s.task is not None and s.conn is not None}
        for conn in multiprocessing.connection.wait(list(busy), timeout=wait) if busy else []:
            slot = busy[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                ended.append(self._lost(slot))
                self._kill(slot)
                continue
            if message.get("ready"):
                slot.ready = True
                slot.deadline = time.monotonic() + slot.timeout  # counted from when grading starts
                conn.send(slot.payload)
                continue
            ended.append(self._end(slot, "done", result=message))
        if not busy:
            time.sleep(wait)
        now = time.monotonic()
        for slot in self._slots:
            if slot.task is not None and now > slot.deadline:
                ended.append(self._end(slot, "timeout", f"still running after {now - slot.started:.0f} s: stopped"))
                self._kill(slot)
        return ended

    def _lost(self, slot: _Slot) -> Outcome:
        """The outcome of a task whose worker vanished: "interrupted" when a stop signal killed it, else "died"."""
        code = None
        if slot.process is not None:
            slot.process.join(timeout=2)  # its pipe closed as it died: reaped in a moment, and then its exit code says how
            code = slot.process.exitcode
        if code is not None and -code in STOP_SIGNALS:
            name = signal.Signals(-code).name
            return self._end(slot, "interrupted", f"stopped by {name} (sent to its worker) before it was graded")
        return self._end(slot, "died", f"the worker process exited (code {code})")

    def _end(self, slot: _Slot, kind: OutcomeKind, detail: str = "", result: dict | None = None) -> Outcome:
        outcome = Outcome(slot.task, result, kind, time.monotonic() - slot.started, detail)
        slot.task, slot.payload = None, {}
        return outcome

    def close(self) -> None:
        """Stop every worker (running jobs are killed with their process trees)."""
        for slot in self._slots:
            if slot.task is None and slot.conn is not None and slot.process is not None and slot.process.is_alive():
                try:
                    slot.conn.send(None)
                    slot.process.join(timeout=5)
                except (OSError, BrokenPipeError):
                    pass
            self._kill(slot)
