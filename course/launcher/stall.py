"""Deadlocks found in seconds, not at the deadline: the ranks' collectives compared.

While a job runs, :class:`StallWatch` samples the CPU time of its ranks. When every rank
still running has been idle for :data:`IDLE_WINDOW` seconds, it asks each one where it is
(the rank's probe thread, :func:`course.launcher.rank.start_stall_probe`, answers with its
last collectives from torch's flight recorder and its main thread's stack) and compares:

* every rank waits in a collective, and they are not the same one (another op, other
  shapes, another sequence number in the same group), or
* some ranks wait in a collective while others have already returned from the function, or
* every rank still running waits in a blocking send or recv (the stacks say so; gloo's flight recorder lists no
  point-to-point operation, and on gloo a send waits for its receive),

then the job is deadlocked: no rank can ever make progress. The same verdict twice in a row,
with no CPU activity in between, ends the job with a :class:`StallVerdict` that lines the
ranks up. Anything else (a rank computing, sleeping, looping; every rank in the same
collective: a slow peer) is left to the job's deadline, so a correct job is never stopped.

Under nccl neither sign holds: a collective returns once it is queued on the GPU, and a rank whose
collective never completes spins in ``.item()``/``.cpu()``/``synchronize`` (busy, and not in
torch.distributed's code). So once a rank of the job has loaded the CUDA driver, the ranks are asked every
:data:`GPU_ASK` seconds, busy or not, and nccl's entries are judged by their state in nccl's flight recorder
(:func:`analyse_nccl`): a collective still queued (not "completed") that another rank issued with another op or
shape at the same sequence number, or that a rank which returned from the function never issued. The stack and
the CPU time say nothing there, and a job whose ranks are stuck in any other way under nccl runs to its deadline:
no verdict rather than a guess.
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
#: seconds between two asks of a job on GPUs (busy or not: a rank waiting for an nccl collective spins)
GPU_ASK = 2.0
#: seconds between two looks for the CUDA driver in a busy job's ranks (their /proc/PID/maps)
GPU_LOOK = 5.0
#: the most entries a rank's probe sends (course.launcher.rank: its latest 16): a fuller list may hide older ones
PROBE_ENTRIES = 16


@dataclass
class StallVerdict:
    """Why the job cannot finish: each rank lined up with its collective and source line."""

    kind: str  # "mismatch" (another op), "shapes", "sequence" (one rank skipped one), "returned", "p2p"
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
        self.on_gpu = False  # a rank has loaded the CUDA driver: asked every GPU_ASK s, busy or not
        self.quiet = False  # on GPUs: no rank was busy since the last ask
        self.next_look = 0.0

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
        if busy and not self.on_gpu and now >= self.next_look:
            self.next_look = now + GPU_LOOK
            self.on_gpu = any(_uses_gpu(self.pids[r]) for r in running)
        if self.on_gpu:
            self.quiet = self.quiet and not busy  # gloo's rule still needs idle ranks: a rank in backward is busy
            self.window_cpu = cpu
            return self._poll_gpu(running, finished, now)
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
            return self._ask(running, now)
        return None

    def _poll_gpu(self, running: list[int], finished: list[int], now: float) -> StallVerdict | None:
        """A job on GPUs: ask every :data:`GPU_ASK` seconds whatever the CPU does; the same verdict twice ends it."""
        if self.asked_at is None:
            if self.window_start is not None and now - self.window_start < GPU_ASK:
                return None
            return self._ask(running, now)
        answers = self._answers(self.asked)
        if answers is None and now - self.asked_at < ANSWER_WAIT:
            return None
        self.asked_at, self.window_start = None, now
        returned = sorted(set(self._returned(running)) | set(finished))
        answers = {**(self._answers(list(finished), missing_ok=True) or {}), **(answers or {})}
        verdict = analyse({r: a for r, a in answers.items() if r not in returned},
                          returned, {r: a for r, a in answers.items() if r in returned})
        if verdict is not None and verdict.key[:1] != ("nccl",) and not self.quiet:
            verdict = None  # gloo's rule on ranks that were busy: a rank computing its backward is not stuck
        self.quiet = True
        if verdict is None:
            self.last_key, self.streak = None, 0
            return None
        self.streak = self.streak + 1 if verdict.key == self.last_key else 1
        self.last_key = verdict.key
        return verdict if self.streak >= CONFIRM else None

    def _ask(self, running: list[int], now: float) -> None:
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


def _uses_gpu(pid: int) -> bool:
    """Whether the process has loaded the CUDA driver (its memory map holds libcuda)."""
    from course.launcher.gpus import driver_used

    return driver_used(f"/proc/{pid}/maps")


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
    every = {**(returned_answers or {}), **answers}
    if any(_nccl(e) for data in every.values() if isinstance(data, dict)
           for e in (data.get("entries") if isinstance(data.get("entries"), list) else [])):
        return analyse_nccl(answers, returned, returned_answers or {})  # the stacks say nothing under nccl
    p2p = _point_to_point(answers, returned)
    if p2p is not None:
        return p2p
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


def _point_to_point(answers: dict[int, dict], returned: list[int]) -> StallVerdict | None:
    """Every rank still running idle in a blocking send or recv (torch's flight recorder lists no point-to-point
    operation on gloo, so the probe reads the function and its peer from the stack), and no two of them a send and
    the receive that takes it: none can make progress (on gloo a send waits for its receive as a receive for its
    send). A pair that could match (a send to b, b's receive from a or from any) may only be slow: no verdict."""
    calls = {r: data.get("p2p") for r, data in answers.items()}
    if not all(data.get("waiting") for data in answers.values()) or not all(isinstance(c, dict) for c in calls.values()):
        return None

    def pair(a: int, b: int) -> bool:  # a send and the receive that could take it
        if {calls[a].get("op"), calls[b].get("op")} != {"send", "recv"}:
            return False
        sender, receiver = (a, b) if calls[a]["op"] == "send" else (b, a)
        return calls[sender].get("peer") in (None, receiver) and calls[receiver].get("peer") in (None, sender)

    if any(pair(a, b) for a in calls for b in calls if a < b):
        return None
    lines = {}
    for r, data in answers.items():
        call, site = calls[r], data.get("site")
        peer = f" {'to' if call['op'] == 'send' else 'from'} rank {call['peer']}" if call.get("peer") is not None else ""
        lines[r] = f"waits in {call['op']}{peer}" + (f" ({site['where']}: {site['line']})" if isinstance(site, dict) else "")
    lines.update({r: "had returned from the function" for r in returned})
    hint = ("every rank waits in a point-to-point send or receive that no other rank will match: a recv waits until "
            "its peer sends, and on gloo a send waits until its peer receives, so two ranks that send to each other "
            "first (or receive first) wait forever. Pair every send with a receive on the other rank, in the same "
            "order on both; or post sends with dist.isend (waiting on them later) or dist.batch_isend_irecv, so that "
            "a rank can receive while its send is pending")
    key = ("p2p", tuple(sorted((r, c.get("op"), c.get("peer")) for r, c in calls.items())), tuple(sorted(returned)))
    return StallVerdict("p2p", lines, sorted(answers), sorted(returned), hint, key)


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


# --------------------------------------------------------------------------- nccl: judged by the entries' states


def _nccl(entry) -> bool:
    return isinstance(entry, dict) and entry.get("backend") == "nccl"


def _step(entry: dict) -> tuple:
    return entry.get("op"), json.dumps(entry.get("sizes")), tuple(entry.get("dtypes") or ())


def _group(entry: dict) -> tuple:
    """A process group, as every rank names it: its name (unique) and description."""
    return entry.get("pg"), entry.get("group")


#: nccl collectives whose input has the same shape on every rank (scatter, gather, all_to_all may differ)
SAME_SHAPE = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "_allgather_base", "all_gather_into_tensor",
                        "_reduce_scatter_base", "reduce_scatter_tensor", "all_reduce_barrier", "allreduce_coalesced",
                        "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"})


def _issued(data: dict | None, group: tuple, seq: int) -> dict | bool | None:
    """What a rank's answer says of collective ``group`` #``seq``: its entry; False when the rank provably never
    issued it (its latest entry of the group is older, or it sent every entry it has and none is of the group);
    None when its answer cannot say (no answer, or the entry is older than the entries the probe sends)."""
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    mine = [e for e in entries if isinstance(e, dict) and not e.get("p2p") and _group(e) == group]
    for e in mine:
        if e.get("seq") == seq:
            return e
    seqs = [int(e.get("seq") or 0) for e in mine]
    if seqs and max(seqs) < seq:
        return False  # sequence numbers only grow: a later collective of the group would be among the latest
    if not seqs and len(entries) < PROBE_ENTRIES:
        return False
    return None


def analyse_nccl(answers: dict[int, dict], returned: list[int], returned_answers: dict[int, dict]) -> StallVerdict | None:
    """The verdict on nccl ranks, from their flight recorders' states alone (nccl's collectives return once queued:
    a rank's stack and CPU time prove nothing). Deadlocked when a collective some rank still in the function has
    queued and not completed was issued by another rank with another op, shape or dtype at the same sequence
    number ("mismatch", "shapes"), or was never issued by a rank that has returned ("returned"). Anything else
    (a rank not yet at the collective, one whose answer cannot say, point-to-point ops) is no verdict."""
    every = {**returned_answers, **answers}
    found: dict[str, dict] = {}  # kind -> {"pending": (rank, entry), "other": (rank, entry or None)}
    pending_of: dict[int, dict] = {}
    for r in sorted(answers):
        entries = answers[r].get("entries") if isinstance(answers[r], dict) else None
        if not isinstance(entries, list):
            continue
        pending = next((e for e in entries if _nccl(e) and not e.get("p2p") and e.get("state") != "completed"
                        and e.get("seq") is not None), None)
        if pending is None:
            continue
        pending_of[r] = pending
        for q in sorted(every):
            if q == r:
                continue
            theirs = _issued(every.get(q), _group(pending), pending.get("seq"))
            if theirs is None:
                continue
            if theirs is False:
                if q in returned:
                    found.setdefault("returned", {"pending": (r, pending), "other": (q, None)})
                continue
            if theirs.get("op") != pending.get("op"):
                found.setdefault("mismatch", {"pending": (r, pending), "other": (q, theirs)})
            elif _step(theirs) != _step(pending) and pending.get("op") in SAME_SHAPE:
                found.setdefault("shapes", {"pending": (r, pending), "other": (q, theirs)})
    kind = next((k for k in ("mismatch", "shapes", "returned") if k in found), None)
    if kind is None:
        return None
    sites = {r: (every.get(r) or {}).get("site") for r in every}
    lines = {r: _describe(e, sites.get(r), "waits in") + ", queued on the GPU and never completed"
             for r, e in pending_of.items()}
    lines.update({r: "had returned from the function" for r in returned})
    for r in sorted(answers):
        lines.setdefault(r, "is in the function, with no nccl collective left uncompleted"
                         + (f" ({sites[r]['where']})" if isinstance(sites.get(r), dict) and sites[r].get("where")
                            else ""))
    (r, mine), (q, theirs) = found[kind]["pending"], found[kind]["other"]
    if theirs is not None:
        lines[q] = _describe(theirs, sites.get(q), "issued") + ("" if q in pending_of else " (then went on)")
    what = f"{mine.get('op')} #{mine.get('seq')}"
    if kind == "mismatch":
        hint = (f"rank {r} queued {what} and rank {q} queued {theirs.get('op')} at the same point: {SAME_COLLECTIVES} "
                "(look for a collective inside `if rank == ...:`)")
    elif kind == "shapes":
        hint = (f"ranks {r} and {q} called {what} with tensors of different shapes or dtypes "
                f"({_shape(mine)} vs {_shape(theirs)}): every rank must pass a tensor of the same shape and dtype "
                "(pad, or all_gather the sizes first)")
    else:
        hint = (f"rank {q} returned without calling {what}, which rank {r} queued and waits for: a collective "
                f"inside `if rank == ...:`, or a loop that runs a different number of times on different ranks; "
                f"{SAME_COLLECTIVES}")
    hint += " (judged from nccl's flight recorder: the collective was queued and never completed)"
    key = ("nccl", kind, tuple(sorted((k, _group(v), v.get("seq"), v.get("op")) for k, v in pending_of.items())),
           tuple(sorted(returned)))
    return StallVerdict(kind, lines, sorted(pending_of), sorted(returned), hint, key)
