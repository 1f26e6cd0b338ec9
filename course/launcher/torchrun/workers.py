"""What torchrun's launcher (:mod:`~course.launcher.torchrun.runner`) and its agent
(:mod:`~course.launcher.torchrun.agent`, run as ``python -m``, which nothing imports) share about the workers:
the file each runs, how the launcher tells a worker from its agent's zygote, and the zygotes' reports of whom
they forked with which RANK."""

from __future__ import annotations

import os
import select
import threading
import time

#: the file every worker runs (torchrun's training script; the script to grade is its first argument)
PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_probe.py")
#: the name a zygote gives itself (``/proc/PID/comm``): the launcher's process walks leave it out of the workers
ZYGOTE_NAME = "zygote"
#: the environment variable naming the descriptor the launcher gives each agent for its zygote's reports
REPORT_FD = "DDP_COURSE_AGENT_REPORT_FD"
#: the environment variable naming, in a worker the agent exec'd (no zygote), the pipe that holds its secret
SECRET_FD = "DDP_COURSE_WORKER_SECRET_FD"


class ZygoteReports:
    """What the agents' zygotes say about the workers they fork (course.launcher.torchrun.agent): a pipe whose
    writing end only the zygotes hold (undumpable, nothing of a submission runs in them) once every agent started.
    ``rank(pid)``: the RANK a forked worker was started with, which /proc/PID/environ cannot tell (it shows the
    zygote's environment); ``zygotes``: their pids (no worker: left out of the processes whose writes are
    watched); ``forks()``: (pid, RANK, secret) of every worker forked, in the order the zygotes forked them (the
    secret: :data:`course.sandbox.zygote.SECRET` in that worker, drawn by its zygote)."""

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._ranks: dict[int, int | None] = {}
        self._forks: list[tuple[int, int | None, int | None]] = []
        self.zygotes: set[int] = set()
        self._buffer = b""
        self._lock = threading.Lock()

    def env(self) -> dict[str, str]:
        return {REPORT_FD: str(self._write)} if self._write is not None else {}

    def fds(self) -> tuple[int, ...]:
        return (self._write,) if self._write is not None else ()

    def started(self) -> None:
        """Every agent has its copy: close ours (the zygotes' are the only ones left)."""
        if self._write is not None:
            os.close(self._write)
            self._write = None

    def _drain(self, wait: float = 0.0) -> None:
        end = time.monotonic() + wait
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except BlockingIOError:
                chunk = None
            except OSError:
                return
            if chunk:
                self._buffer += chunk
                *lines, self._buffer = self._buffer.split(b"\n")
                for line in lines:
                    first, second, third = (line.decode(errors="replace").split() + ["", "", ""])[:3]
                    if first == "Z" and second.isdigit():
                        self.zygotes.add(int(second))
                    elif first.isdigit():
                        rank = int(second) if second.isdigit() else None
                        self._ranks[int(first)] = rank
                        self._forks.append((int(first), rank, int(third) if third.isdigit() else None))
                continue
            if chunk == b"" or time.monotonic() >= end:
                return
            select.select([self._read], [], [], max(0.0, end - time.monotonic()))

    def rank(self, pid: int) -> int | None:
        """The RANK of a worker a zygote forked (it may take a moment to say so), or None."""
        with self._lock:
            self._drain()
            if pid not in self._ranks and parent_of(pid) in self.zygotes:
                self._drain(wait=2.0)  # forked a moment ago: its zygote is about to say so
            return self._ranks.get(pid)

    def forks(self) -> list[tuple[int, int | None, int | None]]:
        with self._lock:
            self._drain()
            return list(self._forks)

    def without_zygotes(self, pids: list[int]) -> list[int]:
        with self._lock:
            self._drain()
            return [p for p in pids if p not in self.zygotes]

    def close(self) -> None:
        self.started()
        os.close(self._read)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` now, from /proc/PID/stat (None: gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
