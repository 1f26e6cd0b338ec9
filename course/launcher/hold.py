"""Hold rank 0's write until every other rank waits for it: synchronisation judged by order, not by a race.

A check that wants "no rank goes on before rank 0's file is complete" cannot learn it from one fixed
delay (any longer sleep passes for a barrier). Instead rank 0's write is held (:meth:`Hold.wait`, called
by the write recorder, :mod:`course.launcher.writes`, before the file is created) until each other rank
either

* waits in torch.distributed: its main thread is blocked inside torch's collective code (a barrier,
  an all_reduce, a ``recv``, ``monitored_barrier``), which rank 0, held before its write, has not
  joined, so it cannot return before the write;
* or has returned from the student's function: it went on before the file existed, which the check
  then reports.

A rank that does neither within the hold's limit (a random number of seconds, so no sleep can be
timed to it) is named in :attr:`Hold.result` ("neither"): it kept running its own code, not waiting
for rank 0. One whose flight recorder shows a collective that rank 0 has not issued yet, but whose
main thread sits elsewhere (``work.wait()`` of an async collective), is let through at the limit
("issued"). (On gloo the flight recorder says what was issued, never what completed, and
``monitored_barrier``'s messages are not in it: the main thread's stack is what shows the waiting.) Each rank reports its state, once rank 0 asks, through a
small file in a folder the ranks share, written by a thread of the grader's (:meth:`Hold.start`).

Under nccl a collective returns once queued, and a rank waiting for rank 0's data spins in ``.item()`` or
``.cpu()``, outside torch.distributed: its stack does not show the waiting, nccl's flight recorder does (read
through :mod:`course.launcher.recorder`, which reads nccl's recorder too). Such a rank has queued a collective
rank 0 has not issued ("issued": never named); ``dist.barrier()`` blocks the CPU under nccl too ("waiting").
"neither" keeps its meaning on both backends: the rank queued nothing that waits for rank 0 and is running its
own code.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback

from course.launcher import writes
from course.launcher.rank import under, waiting_in_collective
from course.launcher.recorder import bind

#: torch.distributed code a rank runs on its way out, which waits for no peer (gloo's destroy returns at once)
LEAVING = frozenset({"destroy_process_group", "_shutdown_backend", "_abort_process_group", "shutdown"})
#: seconds the others must stay waiting, their collectives unchanged, before rank 0 writes: a rank caught passing
#: through torch.distributed (the end of a collective, its way out) moves on within that time; one blocked until
#: rank 0 joins cannot
STEADY = 0.3
POLL = 0.005  # seconds between two looks at the others' state (rank 0) or two reports (the others)


def _flight_recorder():
    reader = bind(stacks=False)  # no stack traces: cheaper, and this is polled
    if reader is None:
        return lambda: []

    def entries() -> list[dict]:
        try:
            return reader()
        except Exception:  # noqa: BLE001 - no recorder answer: nothing is known to be waiting
            return []

    return entries


_entries = _flight_recorder()  # taken when this module is imported: before any student code in a rank


def last_seqs() -> dict[str, int]:
    """This rank's latest sequence number per process group: of its collectives (key: the group's name) and of its
    point-to-point ops (key: name + "/p2p"; ``monitored_barrier`` is made of sends and receives)."""
    seqs: dict[str, int] = {}
    for e in _entries():
        group = e.get("process_group") or ("", "")
        name = str(group[1] if len(group) > 1 else group)
        key, seq = (name + "/p2p", e.get("p2p_seq_id")) if e.get("is_p2p") else (name, e.get("collective_seq_id"))
        seqs[key] = max(seqs.get(key, 0), int(seq or 0))
    return seqs


def _main_thread_state(libraries: tuple[str, ...]) -> tuple[bool, dict | None]:
    """(whether the main thread waits in torch's collective code, its innermost frame of the student's)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    waiting = waiting_in_collective(stack, LEAVING)
    for f in reversed(stack):
        if f.filename.startswith(("<frozen", "<string>")) or under(f.filename, libraries):
            continue
        return waiting, {"file": f.filename, "line": f.lineno, "code": (f.line or "").strip()}
    return waiting, None


class Hold:
    """One hold of rank 0's write, shared by the ranks through ``folder``; ``limit``: the hold's least
    length in seconds (the real one is drawn between ``limit`` and twice that)."""

    def __init__(self, folder: str, rank: int, world_size: int, limit: float, hidden: tuple[str, ...] = ()):
        self.folder, self.rank, self.world_size = folder, rank, world_size
        os.makedirs(folder, exist_ok=True)
        self.limit = limit * (1 + random.SystemRandom().random())  # not the forked ranks' shared PRNG state
        self.hidden = tuple(hidden)
        self.returned_flag = False
        self.stopped = False
        self.result: dict | None = None  # rank 0, after wait(): what the hold saw

    def _status_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"hold-rank{rank}.json")

    # --- the other ranks ------------------------------------------------------------------------
    def start(self) -> None:
        """On every rank but 0: report this rank's state until :meth:`stop`."""
        if self.rank == 0:
            return
        import sysconfig

        libraries = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
        libraries += self.hidden + (os.path.dirname(os.path.abspath(__file__)),)
        path, tmp = self._status_path(self.rank), self._status_path(self.rank) + ".tmp"
        replace, dumps = os.replace, json.dumps

        asked, exists = os.path.join(self.folder, "hold-asked"), os.path.exists

        def report() -> None:
            writes.grader_thread()
            while not self.stopped:
                if not (self.returned_flag or exists(asked)):  # nothing to tell before rank 0 holds its write
                    time.sleep(POLL)
                    continue
                try:
                    waiting, site = _main_thread_state(libraries)
                    data = dumps({"returned": self.returned_flag, "waiting": waiting, "seqs": last_seqs(),
                                  "site": site})
                    with open(tmp, "w") as fh:
                        fh.write(data)
                    replace(tmp, path)
                except Exception:  # noqa: BLE001 - never disturb the rank
                    pass
                if self.returned_flag:
                    return
                time.sleep(POLL)

        self.thread = threading.Thread(target=report, name="ddp-course-hold", daemon=True)
        self.thread.start()

    def returned(self) -> None:
        """On every rank but 0: the student's function returned (call it after looking at the file)."""
        if self.rank == 0:
            return
        self.returned_flag = True
        self.thread.join(timeout=1.0)

    def stop(self) -> None:
        self.stopped = True

    # --- rank 0 ---------------------------------------------------------------------------------
    def wait(self) -> dict:
        """On rank 0, before its write: hold until every other rank waits for rank 0 or has returned
        (at most the limit); the outcome is also kept in :attr:`result`."""
        if self.result is not None:
            return self.result
        start = time.monotonic()
        mine = last_seqs()
        with open(os.path.join(self.folder, "hold-asked"), "w"):
            pass
        others = [r for r in range(self.world_size) if r != self.rank]
        states: dict[int, dict] = {}
        steady_since, steady_seqs = None, None
        while True:
            for r in others:
                try:
                    with open(self._status_path(r)) as fh:
                        states[r] = json.loads(fh.read())
                except (OSError, ValueError):
                    pass
            verdict = {r: self._state(states.get(r), mine) for r in others}
            now = time.monotonic()
            if all(v in ("returned", "waiting") for v in verdict.values()):
                seqs = {r: (states.get(r) or {}).get("seqs") for r, v in verdict.items() if v == "waiting"}
                if steady_since is None or seqs != steady_seqs:
                    steady_since, steady_seqs = now, seqs  # waiting (or returned) from now on: is it steady?
                elif now - steady_since >= STEADY or not seqs:
                    break  # every other rank returned, or has waited STEADY s in the same collective
            else:
                steady_since = steady_seqs = None
            if now - start >= self.limit:
                break
            time.sleep(POLL)
        self.result = {
            "seconds": round(time.monotonic() - start, 3), "limit": round(self.limit, 1),
            "returned": [r for r, v in verdict.items() if v == "returned"],
            "neither": [r for r, v in verdict.items() if v == "neither"],
            "sites": {r: (states.get(r) or {}).get("site") for r in others},
        }
        return self.result

    @staticmethod
    def _state(status: dict | None, mine: dict[str, int]) -> str:
        if not status:
            return "neither"
        if status.get("returned"):
            return "returned"
        seqs = status.get("seqs") or {}
        shared = [g for g in seqs if g in mine or (g.endswith("/p2p") and g[:-4] in mine)]  # groups rank 0 is in
        ahead = any(int(seqs[g]) > mine.get(g, 0) for g in shared)
        if status.get("waiting"):  # blocked in torch.distributed (a barrier, a recv, monitored_barrier ...)
            return "waiting"
        return "issued" if ahead else "neither"
