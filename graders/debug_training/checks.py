"""Checks for exercise 2's fourth notebook, debug a training script (exercises/ex2-ddp-basics/debug_training.ipynb).

The student gets a complete DDP training script, ``main(rank, world_size, model, train_set, val_set,
ckpt_path, log, epochs)`` (exercises/ex2-ddp-basics/buggy_training.py), with four bugs from the
mistakes learners really make, and fixes it. Each check runs the whole script on real ranks and
judges one behaviour, never the lines:

* :func:`check_shuffle`: what reached the model (a forward pre-hook on it): every epoch is a new
  shuffle, and each epoch gives every sample to some rank;
* :func:`check_metric`: every accuracy the script logs equals the accuracy, over the whole
  validation set, of the weights the model held when it was logged; and only rank 0 logs: no other
  rank calls ``log``, prints (its file descriptor 1 goes to a file of the grader's while ``main`` runs;
  ``sys.stderr`` is teed, Python's warnings aside) or emits a ``logging`` record (a handler on the root logger);
* :func:`check_checkpoint`: the file at ``ckpt_path`` loads into the plain model (``strict=True``)
  and holds the trained weights; and only rank 0 writes: no other rank writes any file
  (:func:`course.checks.record_writes`);
* :func:`check_finishes`: every rank returns from ``main`` (no rank waits forever), and none returns
  before rank 0's checkpoint is complete: rank 0's first write into the checkpoint's folder (by any
  means: every write of the rank is recorded) is held until every other rank waits for it in a
  collective or has returned (:class:`course.checks.Hold`).

Each rank's harness writes what it observes to a journal file as it happens, so the first three
checks still judge their behaviour when the script then hangs (the fourth bug stops nothing else
from being graded); a job that crashes fails every check with its traceback. The four checks share
one run of the script (:func:`course.checks.memo`).

Why the course's rules sit in these two checks: logging on every rank makes every metric appear
world_size times (and a tracker open one run per rank), which is what check_metric judges, what the
script reports; every rank writing the checkpoint is what check_checkpoint judges, the saved file (ranks
writing one path at once can leave it corrupt). The given script keeps both rules, so a student who
"fixes" it into breaking one loses that check, and the given script still scores nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile

import torch
import torch.nn as nn

from course import checks
from course.checks import CheckFailed, passed
from graders.common.ddp_model import file_digest
from graders.common.samples import Samples

HOLD_LIMIT = 4.0  # least seconds rank 0's checkpoint write waits for ranks that neither wait for it nor return
JOB_TIMEOUT = 40.0
FEATURES, CLASSES = 4, 3


_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)


# --- data and model ----------------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def accuracy(state: dict, dataset: Samples, seed: int) -> tuple[int, int]:
    """(right, total) of the weights ``state`` over the whole ``dataset``, in one process."""
    model = make_model(seed)
    model.load_state_dict(state)
    with torch.no_grad():
        return int((model(dataset.x).argmax(dim=1) == dataset.y).sum()), len(dataset)


# --- the harness (every rank) ---------------------------------------------------------------------------


class _Journal:
    """Appends one JSON line per observation to ``<folder>/rank<r>.jsonl`` (and tensors to .pt files) at once:
    what was seen survives the job being stopped later."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank, self.count = folder, rank, 0
        self.fd = os.open(os.path.join(folder, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, entry: dict, state: dict | None = None, _save=_REAL.save) -> None:
        with checks.grader_writes():  # the grader's own files: not the rank's writes
            if state is not None:
                self.count += 1
                name = f"rank{self.rank}-state{self.count}.pt"
                _save(checks.to_cpu(state), os.path.join(self.folder, name))
                entry = {**entry, "state": name}
            os.write(self.fd, (json.dumps(entry) + "\n").encode())


class _Records(logging.Handler):
    """Every record the script's logging emits on this rank (torch's own loggers aside), into the journal."""

    def __init__(self, journal: _Journal):
        super().__init__(logging.NOTSET)
        self.journal = journal

    def emit(self, record):
        if not record.name.startswith("torch"):
            self.journal.write({"logging": f"{record.levelname}: {record.getMessage()}"[:200]})


class _Stdout:
    """This rank's stdout (file descriptor 1, so C-level writes too) sent to a file of the grader's while the
    script runs. stderr is left alone: the launcher's stack dumps of a stuck rank go there."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        with checks.grader_writes():
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.saved = os.dup(1)
        os.dup2(self.fd, 1)
        return self

    def __exit__(self, *exc):
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.saved, 1)
        os.close(self.saved)
        os.close(self.fd)
        return False


class _StderrLines:
    """sys.stderr while the script runs: what it writes goes on to the real stderr and, line by line, into the
    journal, apart from Python's warnings (``file:line: SomeWarning: ...`` and the source line under it: torch's,
    not the script's logging). The file descriptor is left alone for the launcher's stack dumps."""

    _WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")

    def __init__(self, journal: _Journal):
        self.journal, self.pending, self.after_warning = journal, "", False

    def __enter__(self):
        self.real = sys.stderr
        sys.stderr = self
        return self

    def __exit__(self, *exc):
        self.write("\n" if self.pending else "")
        sys.stderr = self.real
        return False

    def write(self, text):
        self.real.write(text)
        self.pending += str(text)
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            warning = bool(self._WARNING.match(line))
            if line.strip() and not warning and not (self.after_warning and line.startswith(" ")):
                self.journal.write({"stderr": line[:200]})
            self.after_warning = warning
        return len(text)

    def flush(self):
        self.real.flush()

    def __getattr__(self, name):  # fileno, encoding, isatty, ...: the real stream's
        return getattr(self.real, name)


def _printed(folder: str, rank: int) -> list[str]:
    try:
        with open(os.path.join(folder, f"rank{rank}.out"), errors="replace") as fh:
            return [line.rstrip("\n") for line in fh if line.strip()]
    except OSError:
        return []


def _harness(rank, main, folder, ckpt_path, n_train, n_val, epochs, seed, hold_limit, _real=_REAL):
    dev = checks.join_job()
    world_size = _real.get_world_size()
    journal = _Journal(folder, rank)
    model = make_model(seed + 100 * rank).to(dev)  # DDP makes them equal (rank 0's)
    train_set, val_set = Samples(n_train, seed), Samples(n_val, seed + 1)

    def on_forward(module, args):
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            journal.write({"forward": train_set.indices_of(args[0])})

    model.register_forward_pre_hook(checks.grader_hook(on_forward))  # a script that pickles the model meets no closure

    def log(metrics, *args, **kwargs):
        value = metrics.get("accuracy") if isinstance(metrics, dict) else None
        value = float(value.item() if isinstance(value, torch.Tensor) else value) if value is not None else None
        journal.write({"log": value, "keys": sorted(map(str, metrics)) if isinstance(metrics, dict) else []},
                      state=model.state_dict())

    hold = checks.Hold(os.path.join(folder, "hold"), rank, world_size, hold_limit)
    ckpt_folder = os.path.dirname(ckpt_path)

    def before(event):  # every write is noted; rank 0's into the checkpoint's folder waits for the others
        journal.write({"wrote": event["path"]})
        if rank == 0 and os.path.dirname(event["path"]) == ckpt_folder and hold.result is None:
            journal.write({"hold": hold.wait()})

    records = _Records(journal)
    logging.getLogger().addHandler(records)
    hold.start()
    try:
        with _Stdout(os.path.join(folder, f"rank{rank}.out")), _StderrLines(journal), checks.record_writes(before):
            main(rank, world_size, model, train_set, val_set, ckpt_path, log, epochs)
        seen = file_digest(ckpt_path)  # the checkpoint as this rank finds it the moment main returned
    finally:
        hold.returned()
        hold.stop()
        logging.getLogger().removeHandler(records)
    journal.write({"returned": True, "seen": seen}, state=model.state_dict())
    return True


def _read(folder: str, world_size: int) -> list[list[dict]]:
    out = []
    for rank in range(world_size):
        entries = []
        try:
            with open(os.path.join(folder, f"rank{rank}.jsonl")) as fh:
                for line in fh:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if "state" in entry:
                        try:
                            entry["state"] = torch.load(os.path.join(folder, entry["state"]), weights_only=True)
                        except Exception:  # noqa: BLE001 - a half-written file: the job was stopped
                            entry["state"] = None
                    entries.append(entry)
        except OSError:
            pass
        out.append(entries)
    return out


class _Run:
    """One run of the student's main: the journals, what each rank printed, the checkpoint, how the job ended."""

    def __init__(self, journals, printed, ckpt, ckpt_digest, failure: CheckFailed | None, hung: bool):
        self.journals, self.printed, self.ckpt, self.ckpt_digest = journals, printed, ckpt, ckpt_digest
        self.failure, self.hung = failure, hung


_STUCK_HINT = ("a rank waits in a collective that the other ranks never call (they returned from main): a collective "
               "runs only when every rank calls it. Whatever only rank 0 does (saving, logging) may be inside "
               "`if rank == 0:`; what all ranks wait for must not be")


def _run(check, main, *, world_size, n_train, n_val, epochs, seed) -> _Run:
    """Run the student's ``main`` once for all four checks (:func:`course.checks.memo`): not written yet, or a
    crash, fails the asking check at once (the crash's traceback is the message); a hang is kept in the run
    (:attr:`_Run.hung`) for each check to judge."""
    checks.require_written(check, main=main)
    run = checks.memo(check, ("debug_training", main, world_size, n_train, n_val, epochs, seed), lambda: _run_job(
        "check_finishes", main, world_size=world_size, n_train=n_train, n_val=n_val, epochs=epochs, seed=seed,
        hints=[("timeout", _STUCK_HINT)]))
    if run.failure is not None and not run.hung:
        raise _as(check, run.failure)
    return run


def _as(check: str, err: CheckFailed) -> CheckFailed:
    """The job's failure, under the name of the check that reports it."""
    return CheckFailed(check, err.problem, ranks=err.ranks, expected=err.expected, got=err.got, hint=err.hint,
                       detail=err.detail)


def _run_job(check, main, *, world_size, n_train, n_val, epochs, seed, hints) -> _Run:
    """The job itself, in a folder of its own: the ranks' journals, the checkpoint, how the job ended."""
    folder = tempfile.mkdtemp(prefix="ddp-course-debug-")
    try:
        ckpt_path = os.path.join(folder, "ckpt.pt")
        failure, hung = None, False
        try:
            timeout = min(checks.check_timeout(), JOB_TIMEOUT)
            checks.run(check, _harness, world_size,
                       args=(main, folder, ckpt_path, n_train, n_val, epochs, seed, min(HOLD_LIMIT, timeout / 6)),
                       hints=list(hints), timeout=timeout)
        except CheckFailed as err:
            failure, hung = err, err.hung
        ckpt = None
        if os.path.exists(ckpt_path):
            try:
                ckpt = torch.load(ckpt_path, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - what a student's file holds is theirs
                ckpt = exc
        return _Run(_read(folder, world_size), [_printed(folder, r) for r in range(world_size)], ckpt,
                    file_digest(ckpt_path), failure, hung)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _after_hang(run: _Run) -> str:
    return (" (the job did not finish: check_finishes says why; this check judged what happened before)"
            if run.hung else "")


# --- the checks --------------------------------------------------------------------------------------------


def check_shuffle(main, *, world_size=2, n_train=24, n_val=11, epochs=3, seed=0):
    """Each epoch is a new order (a reshuffle, the same on every rank), and gives every sample to some rank."""
    check = "check_shuffle"
    run = _run(check, main, world_size=world_size, n_train=n_train, n_val=n_val, epochs=epochs, seed=seed)
    per_rank = -(-n_train // world_size)  # DistributedSampler pads every rank's share to this
    orders = []
    for rank, journal in enumerate(run.journals):
        seen = [i for e in journal if "forward" in e for i in e["forward"]]
        if len(seen) < epochs * per_rank:
            raise CheckFailed(check, f"rank {rank}'s model was trained on {len(seen)} samples in {epochs} epochs"
                              + _after_hang(run), ranks=[rank],
                              expected=f"{per_rank} samples per epoch ({n_train} samples on {world_size} ranks)",
                              hint="train every epoch on this rank's whole share (the DistributedSampler's loader)")
        orders.append([seen[e * per_rank:(e + 1) * per_rank] for e in range(epochs)])
    for epoch in range(epochs):
        covered = {i for rank_orders in orders for i in rank_orders[epoch]}
        missing = sorted(set(range(n_train)) - covered)
        if missing:
            raise CheckFailed(check, f"epoch {epoch + 1} never trained on {len(missing)} of the {n_train} samples",
                              ranks=list(range(world_size)),
                              expected="every sample on some rank in every epoch", got=f"missing: {missing[:8]}",
                              hint="every rank must shuffle the same way in an epoch (the same seed and epoch "
                              "number), so that the ranks' shares do not overlap")
    for rank, rank_orders in enumerate(orders):
        for epoch in range(1, epochs):
            if rank_orders[epoch] == rank_orders[epoch - 1]:
                raise CheckFailed(
                    check, f"epochs {epoch} and {epoch + 1} fed rank {rank}'s model the same samples in the same order",
                    ranks=[rank], expected="a new shuffle every epoch",
                    got=f"both epochs: {rank_orders[epoch][:8]}{' ...' if per_rank > 8 else ''}",
                    hint="the DistributedSampler shuffles with its seed and the epoch number it was last given; if "
                    "nothing tells it a new epoch has begun, every epoch repeats the first one's order (the model "
                    "sees the same batches again and again)")
    passed(check)


def check_metric(main, *, world_size=2, n_train=24, n_val=11, epochs=3, seed=0):
    """Every logged accuracy is the accuracy over the whole validation set of the weights the model held then."""
    check = "check_metric"
    run = _run(check, main, world_size=world_size, n_train=n_train, n_val=n_val, epochs=epochs, seed=seed)
    val_set = Samples(n_val, seed + 1)
    calls = [(rank, e) for rank, journal in enumerate(run.journals) for e in journal if "log" in e]
    # the accuracies: a log call of other metrics (a training loss, the epoch) is the script's own business
    logs = [(rank, e) for rank, e in calls if "accuracy" in e["keys"]]
    if len(logs) < epochs:
        other = sorted({k for _, e in calls for k in e["keys"]} - {"accuracy"})
        raise CheckFailed(check, f"the script logged {len(logs)} accuracies in {epochs} epochs" + _after_hang(run),
                          expected="at least one log({'accuracy': ...}) per epoch",
                          got=f"log calls with the keys {other}" if other else None,
                          hint="log the validation accuracy after every epoch, with the key 'accuracy'")
    for rank, entry in logs:
        if entry["log"] is None or entry["state"] is None:
            raise CheckFailed(check, "a log call's 'accuracy' was no number", ranks=[rank],
                              expected="log({'epoch': epoch, 'accuracy': <a number>})", got=f"keys {entry['keys']}",
                              hint="log the accuracy as a number (a float, or a one-element tensor)")
        right, total = accuracy(entry["state"], val_set, seed)
        if abs(entry["log"] - right / total) > 1e-6:
            shares = [range(r, n_val, world_size) for r in range(world_size)]
            model = make_model(seed)
            model.load_state_dict(entry["state"])
            with torch.no_grad():
                hits = (model(val_set.x).argmax(dim=1) == val_set.y).tolist()
            mean_of_ranks = sum(sum(hits[i] for i in s) / len(s) for s in shares) / world_size
            why = ("it is the mean of the ranks' own accuracies: each rank's share has another number of samples, so "
                   "the mean of the ratios is not the ratio of the totals"
                   if abs(entry["log"] - mean_of_ranks) <= 1e-6 else
                   "it is not the fraction of the whole validation set that the model gets right")
            raise CheckFailed(check, f"rank {rank} logged an accuracy the model does not have" + _after_hang(run),
                              ranks=[rank],
                              expected=f"{right / total:.6f} ({right} right of the {total} validation samples, with "
                              "the weights the model held at the log call)",
                              got=f"{entry['log']:.6f}", hint=why)
    _only_rank0_logs(check, run)
    passed(check)


def _only_rank0_logs(check: str, run: _Run) -> None:
    """The course's rule: only rank 0 logs (the log function, print, the logging module)."""
    found = {}
    for rank, journal in enumerate(run.journals[1:], start=1):
        calls = [e for e in journal if "log" in e]
        records = [e["logging"] for e in journal if "logging" in e]
        printed = (run.printed[rank] if rank < len(run.printed) else []) + [e["stderr"] for e in journal
                                                                             if "stderr" in e]
        if calls:
            found[rank] = f"called log({{'accuracy': ...}}) {len(calls)} time(s)"
        elif records:
            found[rank] = f"logged \"{records[0]}\" through logging"
        elif printed:
            found[rank] = f"printed \"{printed[0][:120]}\""
    if found:
        rank, what = next(iter(found.items()))
        raise CheckFailed(check, f"{checks.rank_list(list(found))} also logged: only rank 0 logs" + _after_hang(run),
                          ranks=list(found), expected="log(...), print and logging output on rank 0 only",
                          got=f"rank {rank} {what}",
                          hint="every rank runs the same code, so a line logged on every rank appears world_size "
                          "times and an experiment tracker gets one run per rank; after the all-reduce rank 0 holds "
                          "the global numbers. Log inside `if rank == 0:` and keep every collective (the "
                          "evaluation's all-reduce) outside it")


def check_checkpoint(main, *, world_size=2, n_train=24, n_val=11, epochs=3, seed=0):
    """The checkpoint at ckpt_path loads into the plain model (strict) and holds the trained weights."""
    check = "check_checkpoint"
    run = _run(check, main, world_size=world_size, n_train=n_train, n_val=n_val, epochs=epochs, seed=seed)
    ckpt = run.ckpt
    if ckpt is None:
        raise CheckFailed(check, "there is no checkpoint at ckpt_path" + _after_hang(run),
                          expected="rank 0 writes torch.save(..., ckpt_path) at the end", hint="save to ckpt_path")
    if isinstance(ckpt, Exception):
        raise CheckFailed(check, "the checkpoint cannot be read back" + _after_hang(run),
                          expected="torch.load(ckpt_path, weights_only=True) works (tensors, dicts, numbers)",
                          got=f"{type(ckpt).__name__}: {str(ckpt).splitlines()[0][:200]}",
                          hint="save plain data: a dict with the epoch and the model's state_dict")
    state = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else ckpt
    model = make_model(seed)
    try:
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - load_state_dict's own message names the keys
        raise CheckFailed(check, "the checkpoint does not load into the model without DDP" + _after_hang(run),
                          expected="model.load_state_dict(checkpoint['model']) works (strict) on a plain model",
                          got=_short(" ".join(line.strip() for line in str(exc).strip().splitlines())),
                          hint="the saved weights only fit a model wrapped the way it was when it was saved: their "
                          "names carry the wrapper's prefix. Whoever loads it (evaluation, another script, a "
                          "single GPU) has the model itself") from None
    final = _final_state(run.journals[0])
    if final is not None:
        differ = [k for k in final if not torch.equal(final[k].cpu(), model.state_dict()[k])]
        if differ:
            raise CheckFailed(check, "the checkpoint does not hold the trained weights" + _after_hang(run), ranks=[0],
                              expected="rank 0's weights at the end of training",
                              got=f"{len(differ)} tensors differ, e.g. `{differ[0]}`",
                              hint="save at the end, after the last epoch's training")
    _only_rank0_writes(check, run)
    passed(check)


def _only_rank0_writes(check: str, run: _Run) -> None:
    """The course's rule: only rank 0 writes files (every write each rank made is in its journal)."""
    others = {rank: [e["wrote"] for e in journal if "wrote" in e]
              for rank, journal in enumerate(run.journals) if rank != 0}
    others = {rank: paths for rank, paths in others.items() if paths}
    if others:
        rank, paths = next(iter(others.items()))
        same = any(os.path.basename(p) == "ckpt.pt" for p in paths)
        raise CheckFailed(check, f"{checks.rank_list(list(others))} also wrote {'the checkpoint' if same else 'a file'}: "
                          "only rank 0 saves" + _after_hang(run), ranks=list(others),
                          expected="rank 0 writes the checkpoint; no other rank writes any file",
                          got=f"rank {rank} wrote {', '.join(sorted(set(paths))[:3])}",
                          hint="every rank holds the same weights, so one copy is enough: ranks writing the same "
                          "file at once can leave it corrupt, and world_size copies waste time and disk. Save "
                          "inside `if rank == 0:`, and let the other ranks wait for it outside the guard")


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _final_state(journal: list[dict]):
    """Rank 0's weights when main returned, else the last ones it logged (the job hung before the end)."""
    states = [e["state"] for e in journal if e.get("state") is not None]
    return states[-1] if states else None


def check_finishes(main, *, world_size=2, n_train=24, n_val=11, epochs=3, seed=0):
    """Every rank returns from main, and none before rank 0's checkpoint is complete."""
    check = "check_finishes"
    run = _run(check, main, world_size=world_size, n_train=n_train, n_val=n_val, epochs=epochs, seed=seed)
    if run.failure is not None:
        raise _as(check, run.failure)
    barrier = "the other ranks must wait until rank 0 has saved: something every rank calls, after the save"
    early = [r for r, journal in enumerate(run.journals)
             for e in journal if e.get("returned") and e.get("seen") != run.ckpt_digest]
    if early:
        raise CheckFailed(check, f"{checks.rank_list(early)} returned from main before the checkpoint was complete",
                          ranks=early, expected="every rank finds rank 0's whole checkpoint when main returns",
                          got="rank 0 was still writing it (the grader wrote it only once the other ranks waited "
                          "for it or had returned)", hint=barrier)
    hold = next((e["hold"] for e in run.journals[0] if "hold" in e), {}) if run.journals else {}
    checks.did_not_wait(check, hold, "checkpoint", returned="returned from main",
                        expected="every other rank waits until rank 0's checkpoint is complete",
                        hint=barrier + " (a sleep is not: no fixed time is long enough on every disk)")
    passed(check)
