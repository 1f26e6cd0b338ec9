"""Deadlocks found in seconds, not at the deadline: the ranks' collectives compared.

While a job runs, :class:`StallWatch` samples the CPU time of its ranks. When every rank
still running has been idle for :data:`IDLE_WINDOW` seconds, it asks each one where it is
(the rank's probe thread, :func:`course.launcher.rank.start_stall_probe`, answers with its
last collectives from torch's flight recorder and its main thread's stack) and compares:

* every rank waits in a collective, and they are not the same one (another op, other
  shapes, another sequence number in the same group), or
* some ranks wait in a collective while others have already returned from the function,

then the job is deadlocked: no rank can ever make progress. The same verdict twice in a row,
with no CPU activity in between, ends the job with a :class:`StallVerdict` that lines the
ranks up. Anything else (a rank computing, sleeping, looping; every rank in the same
collective: a slow peer) is left to the job's deadline, so a correct job is never stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from course.errors import SAME_COLLECTIVES

#: seconds every running rank must stay idle before they are asked where they are (a job may ask for a shorter
#: window: the grader's own runs of scripts it knows hang, see :func:`course.launcher.job.launch`)
IDLE_WINDOW = 1.0
#: CPU seconds a rank may use within the window and still count as idle (its threads included)
IDLE_CPU = 0.05
#: how often the ranks' CPU time is sampled (seconds)
SAMPLE = 0.25
#: seconds to wait for the ranks' answers
ANSWER_WAIT = 1.5
#: the same verdict this many times in a row ends the job
CONFIRM = 2


@dataclass
class StallVerdict:
    """Why the job cannot finish: each rank lined up with its collective and source line."""

    kind: str  # "mismatch" (another op), "shapes", "sequence" (one rank skipped one), "returned"
    lines: dict[int, str]  # rank -> "waits in all_reduce #3 (Cell In[4], line 12: dist.all_reduce(t))"
    waiting: list[int]
    returned: list[int]
    hint: str
    key: tuple = field(default=(), compare=False)

    @property
    def summary(self) -> str:
        return "; ".join(self._lined_up())

    @property
    def lined_up(self) -> str:
        """One line per rank: "rank 0 waits in all_reduce #3 (...)"."""
        return "\n".join(self._lined_up())

    def _lined_up(self) -> list[str]:
        return [f"rank {r} {self.lines[r]}" for r in sorted(self.lines)]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), from /proc; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class StallWatch:
    """Polled by the launcher's wait loop; :meth:`poll` returns a verdict once the job is deadlocked."""

    def __init__(self, pids: list[int], probe_paths: list[str], result_paths: list[str],
                 idle_window: float = IDLE_WINDOW):
        self.pids, self.probe_paths, self.result_paths = pids, probe_paths, result_paths
        self.idle_window = idle_window
        self.next_sample = 0.0
        self.window_start: float | None = None
        self.window_cpu: dict[int, float] = {}
        self.asked_at: float | None = None
        self.asked: list[int] = []
        self.last_key: tuple | None = None
        self.streak = 0

    def poll(self, running: list[int], now: float | None = None, finished: list[int] = ()) -> StallVerdict | None:
        """``running``: ranks whose process is alive; ``finished``: ranks whose function returned and whose
        process has exited since (torchrun's workers do; their probe answered as they exited)."""
        now = time.monotonic() if now is None else now
        if now < self.next_sample or not running:
            return None
        self.next_sample = now + SAMPLE
        cpu = {r: _cpu_seconds(self.pids[r]) for r in running}
        if any(v is None for v in cpu.values()):
            return None
        busy = (self.window_start is None or set(cpu) != set(self.window_cpu)
                or any(cpu[r] - self.window_cpu[r] > IDLE_CPU for r in cpu))
        if busy:
            self._restart(now, cpu)
            return None
        if self.asked_at is not None:
            answers = self._answers(self.asked)
            if answers is None and now - self.asked_at < ANSWER_WAIT:
                return None
            self.asked_at = None
            returned = sorted(set(self._returned(running)) | set(finished))
            gone = self._answers(list(finished), missing_ok=True) or {}
            answers = {**gone, **(answers or {})}
            verdict = analyse({r: a for r, a in answers.items() if r not in returned},
                              returned, {r: a for r, a in answers.items() if r in returned})
            if verdict is None:
                self.last_key, self.streak = None, 0
                self.window_start, self.window_cpu = now, cpu  # look again after another idle window
                return None
            self.streak = self.streak + 1 if verdict.key == self.last_key else 1
            self.last_key = verdict.key
            if self.streak >= CONFIRM:
                return verdict
            self.window_start, self.window_cpu = now, cpu
            return None
        if now - self.window_start >= self.idle_window:
            self.asked = list(running)  # the returned ones too: what they issued before returning
            for r in self.asked:
                _remove(self.probe_paths[r])
                try:
                    with open(self.probe_paths[r] + ".req", "w"):
                        pass
                except OSError:
                    return None
            self.asked_at = now
        return None

    def _restart(self, now: float, cpu: dict[int, float]) -> None:
        if self.window_start is not None and self.last_key is not None:
            self.last_key, self.streak = None, 0  # activity between two verdicts: not a deadlock
        self.window_start, self.window_cpu = now, cpu
        self.asked_at = None

    def _returned(self, running: list[int]) -> list[int]:
        """Ranks still alive whose function has returned (they wait for the others to finish)."""
        return [r for r in running if os.path.exists(self.result_paths[r])]

    def _answers(self, ranks: list[int], missing_ok: bool = False) -> dict[int, dict] | None:
        found = {}
        for r in ranks:
            try:
                with open(self.probe_paths[r], "rb") as fh:
                    data = json.loads(fh.read(1 << 20))
            except (OSError, ValueError):
                if missing_ok:
                    continue
                return None
            if not isinstance(data, dict):
                return None
            found[r] = data
        return found


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _last(entries: list) -> dict | None:
    """The rank's latest collective (point-to-point ops aside: they pair by peer, not by order)."""
    for entry in reversed(entries):
        if isinstance(entry, dict) and not entry.get("p2p"):
            return entry
    return None


def _latest(entries: list) -> dict | None:
    return next((e for e in reversed(entries) if isinstance(e, dict)), None)


def _describe(entry: dict | None, site: dict | None, verb: str = "waits in") -> str:
    if entry and entry.get("p2p"):
        entry = {**entry, "seq": entry.get("p2p_seq")}
    what = (f"{verb} {entry.get('op') or 'a collective'} #{entry.get('seq')}"
            + (f" of shape {_shape(entry)}" if entry.get("sizes") else "")
            if entry else f"{verb} a collective")
    if isinstance(site, dict) and site.get("where"):
        code = f": {site['line']}" if site.get("line") else ""
        what += f" ({site['where']}{code})"
    return what


def _shape(entry: dict) -> str:
    sizes = entry.get("sizes") or []
    return ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in sizes if isinstance(s, list)) or "[]"


def analyse(answers: dict[int, dict], returned: list[int],
            returned_answers: dict[int, dict] | None = None) -> StallVerdict | None:
    """The verdict on the answers of the ranks still in the function (``answers``), or None when they do
    not prove a deadlock. ``returned``: ranks already back from the function; ``returned_answers``: what
    those issued (to tell "it skipped the collective" from "it did it with another shape")."""
    if not answers:
        return None
    for data in answers.values():
        if not data.get("waiting") or not isinstance(data.get("entries"), list):
            return None  # a rank computing, sleeping or looping (or no flight recorder): the deadline decides
    last = {r: _last(data["entries"]) for r, data in answers.items()}
    if any(entry is None for entry in last.values()):
        return None  # a rank that has issued no collective yet is not waiting in one
    shown = {r: _latest(data["entries"]) for r, data in answers.items()}  # a send/recv is named too
    sites = {r: data.get("site") for r, data in answers.items()}
    waiting = sorted(answers)
    if returned:
        lines = {r: _describe(shown[r], sites[r]) for r in waiting}
        same = _same_step(last, waiting, returned_answers or {})
        if same is not None:
            kind, matches = same
            for r, entry in matches.items():
                lines[r] = _describe(entry, None, "returned after")
            lines.update({r: "had returned from the function" for r in returned if r not in matches})
            if kind == "shapes":
                hint = ("the ranks called the same collective with tensors of different shapes or dtypes: the ranks "
                        "whose part was done returned, the others wait for data that never comes; every rank must pass "
                        "a tensor of the same shape and dtype (pad, or all_gather the sizes first)")
            else:
                hint = (f"the ranks called different collectives at the same point: {SAME_COLLECTIVES} "
                        "(look for a collective inside `if rank == ...:`)")
            return StallVerdict(kind, lines, waiting, sorted(returned), hint,
                                (kind, tuple(waiting), tuple(sorted(returned))))
        lines.update({r: "had returned from the function" for r in returned})
        key = ("returned", tuple(waiting), tuple(sorted(returned)),
               tuple((last[r] or {}).get("seq") for r in waiting))
        return StallVerdict(
            "returned", lines, waiting, sorted(returned),
            f"{_ranks(returned)} returned without calling the collective {_ranks(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} in: a collective inside `if rank == ...:`, or a loop "
            f"that runs a different number of times on different ranks (uneven data); {SAME_COLLECTIVES}",
            key)
    keys = {r: (e.get("group"), e.get("seq"), e.get("op"), json.dumps(e.get("sizes")), tuple(e.get("dtypes") or ()))
            if e else None for r, e in last.items()}
    if len(set(keys.values())) == 1:
        return None  # every rank is in the same collective: slow, not stuck
    lines = {r: _describe(shown[r], sites[r]) for r in waiting}
    seqs = {(last[r] or {}).get("seq") for r in waiting}
    ops = {(last[r] or {}).get("op") for r in waiting}
    if len(seqs) > 1:
        kind = "sequence"
        ahead = [r for r in waiting if (last[r] or {}).get("seq") == max(s for s in seqs if s is not None)]
        hint = (f"the ranks are at different collectives: {_ranks(ahead)} already issued collective "
                f"#{max(s for s in seqs if s is not None)} while the others wait at an earlier one: one rank called "
                "a collective the others skipped (a collective inside `if rank == ...:`)")
    elif len(ops) > 1:
        kind = "mismatch"
        hint = ("the ranks called different collectives at the same point ("
                + " vs ".join(sorted(str(o) for o in ops)) + f"): {SAME_COLLECTIVES} "
                "(look for a collective inside `if rank == ...:`)")
    else:
        kind = "shapes"
        hint = ("the ranks called the same collective with tensors of different shapes or dtypes: every rank must "
                "pass a tensor of the same shape and dtype (pad, or all_gather the sizes first)")
    return StallVerdict(kind, lines, waiting, [], hint, ("diverged", tuple(sorted(keys.items(), key=str))))


def _same_step(last: dict, waiting: list[int], returned_answers: dict[int, dict]):
    """("shapes" or "mismatch", {returned rank: its entry}) when returned ranks issued the waiting ranks'
    collective step (same group and sequence number) with other shapes or another op; else None."""
    matches, kinds = {}, set()
    for r, data in returned_answers.items():
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            continue
        for w in waiting:
            mine = last.get(w)
            if not mine:
                continue
            for entry in entries:
                if (isinstance(entry, dict) and not entry.get("p2p") and entry.get("seq") == mine.get("seq")
                        and entry.get("group") == mine.get("group")):
                    if entry.get("op") != mine.get("op"):
                        kinds.add("mismatch")
                    elif (entry.get("sizes"), entry.get("dtypes")) != (mine.get("sizes"), mine.get("dtypes")):
                        kinds.add("shapes")
                    else:
                        continue
                    matches[r] = entry
    if not matches:
        return None
    return ("mismatch" if "mismatch" in kinds else "shapes"), matches


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
