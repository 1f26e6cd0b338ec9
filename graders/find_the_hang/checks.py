"""Checks for exercise 4's drill, find the hang (exercises/ex4-torchrun/find_the_hang.ipynb).

The student gets four training functions that hang (``exercises/ex4-torchrun/hang_*.py``): a collective
under a rank condition (``metric``), ranks that run different numbers of steps (``uneven``), a barrier
after an early return (``early``), a collective whose tensor's shape depends on the rank's data
(``shapes``). Each script is a given, right training function and the small function it calls, where the bug
is (``hm.SCRIPTS``: the metric's logging, the ranks' shares, the predict-write-merge tail, the per-class counts).
Each part is graded twice:

* :func:`check_diagnosis` (through ``check_diagnosis_<part>``): the student's ``diagnose(job)`` returns,
  for the job's settings, which ranks, which collective and which line of the script. The check runs the
  script itself, unchanged, with those settings, and derives the truth from what its ranks did
  (:mod:`graders.find_the_hang.harness`: each rank's flight recorder with the issuing lines, and where the
  function returned); hidden variants change the world size, the data and the logging rank, and the
  truth with them.
* :func:`check_fix` (through ``check_fix_<part>``): the student's fixed small function runs as a real job,
  called by the script's given training in place of the buggy one: it finishes, every rank issued the same
  collectives (a timeout or a caught exception that lets a rank go on does not), and it trains and logs what the
  script's docstrings promise (the weights against a single-process reference, every sample trained on, the
  logged metric against the one computed here from the weights the model held when it was logged). What it judges
  from is out of the student's function's reach (:mod:`graders.find_the_hang.evidence`): each rank holds the real
  validation features of its own share only, a failed barrier is read from what the process group wrote to the
  rank's standard error (kept by the launcher), rank 0's waiting from torch's own code objects.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.find_the_hang import evidence as ev
from graders.find_the_hang import harness as hm

EPOCHS, BATCH, LR = 2, 4, 0.1
JOB_TIMEOUT = 20.0
#: idle seconds before the stall detector asks the ranks of the grader's own run of a hanging script where they
#: are (the launcher's default is 1 s): that run is known to hang, and a verdict still needs two identical
#: answers with no CPU activity between them, so only the wait shrinks (about 1 s of each diagnosis)
TRUTH_STALL_WINDOW = 0.5
HOLD_LIMIT = 4.0  # seconds a rank's prediction file waits for rank 0 to wait for it (part "early")
ATOL = 1e-5

_REAL = checks.REAL

#: what each part's diagnosis asks, for the messages
QUESTION = {
    "metric": "the rank(s) that call a collective which the other ranks never call",
    "uneven": "the rank(s) left waiting: they run more steps than another rank",
    "early": "the rank(s) that leave the function early, without the collective the others wait in",
    "shapes": "the rank(s) whose tensor is smaller than the other ranks' in the collective",
}
LINE = {
    "metric": "the line that calls that collective",
    "uneven": "the line at which the waiting ranks wait",
    "early": "the line at which those ranks leave (the cause), not where the others wait",
    "shapes": "the line of the collective whose shapes differ",
}


def _settings(part, world_size, n_train, n_val, seed, classes=3, log_rank=0):
    s = {"part": part, "world_size": int(world_size), "n_train": int(n_train), "n_val": int(n_val), "seed": int(seed),
         "classes": int(classes), "epochs": EPOCHS, "batch_size": BATCH, "lr": LR}
    if part == "metric":
        s["log_rank"] = int(log_rank)
    if part == "uneven":
        s["batch_size"] = 5 if world_size == 2 else 3
    return s


def _kwargs(s: dict, out_dir: str | None) -> dict:
    kw = {"epochs": s["epochs"], "batch_size": s["batch_size"], "lr": s["lr"]}
    if s["part"] == "metric":
        kw["log_rank"] = s["log_rank"]
    if s["part"] == "early":
        kw["out_dir"] = out_dir
    return kw


def _data(s: dict):
    return hm.Samples(s["n_train"], s["seed"], s["classes"]), hm.Samples(s["n_val"], s["seed"] + 1, s["classes"])


def job_settings(s: dict) -> dict:
    """What the student's diagnose(job) is given: the job's settings (and, for "shapes", the validation labels)."""
    job = {k: s[k] for k in ("world_size", "n_train", "n_val", "batch_size", "epochs", "classes")}
    if s["part"] == "metric":
        job["log_rank"] = s["log_rank"]
    if s["part"] == "shapes":
        job["val_labels"] = _data(s)[1].y.tolist()
    return job


# --- the buggy run: the truth ------------------------------------------------------------------------------


def _buggy_harness(rank, train, buggy, folder, s):
    dev = checks.join_job()
    world_size = _REAL.get_world_size()
    model = hm.make_model(s["seed"], s["classes"]).to(dev)
    train_set, val_set = _data(s)
    journal = hm.Journal(folder, rank, hm.SCRIPTS[s["part"]][0])
    journal.start()
    out_dir = os.path.join(folder, "out")
    journal.call(train, rank, world_size, model, train_set, val_set, lambda *a, **k: None, watch=buggy,
                 **_kwargs(s, out_dir), **{hm.SCRIPTS[s["part"]][2]: buggy})
    return True


@checks.reference
def truth(s_items: tuple) -> dict:
    """Run the part's script, unchanged, with settings ``s``; what its ranks did, and the diagnosis it shows."""
    s = dict(s_items)
    check = f"check_diagnosis_{s['part']}"
    folder = tempfile.mkdtemp(prefix="ddp-course-hang-")
    try:
        os.makedirs(os.path.join(folder, "out"))
        try:
            checks.run(check, _buggy_harness, s["world_size"],
                       args=(hm.load_script(s["part"]), hm.buggy_function(s["part"]), folder, s),
                       timeout=min(checks.check_timeout(), JOB_TIMEOUT), stall_window=TRUTH_STALL_WINDOW)
            finished = True
        except CheckFailed:
            finished = False
        journals = hm.read_journals(folder, s["world_size"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if finished:
        raise CheckFailed(check, f"the grader's own run of {hm.SCRIPTS[s['part']][0]} did not hang with these "
                          f"settings ({job_settings(s)}), so there is nothing to diagnose",
                          hint="this is a problem of the exercise, not of your answer: tell your instructor")
    return derive(s["part"], journals)


def _key(entry):
    return None if entry is None else (entry["op"], str(entry["sizes"]), entry["line"])


def derive(part: str, journals: list[dict]) -> dict:
    """The diagnosis the ranks' journals show: {"ranks", "collective", "line", "symptom_lines"}."""
    seqs = [[e for e in j["entries"]] for j in journals]
    size = max(len(s) for s in seqs)
    at = lambda r, i: seqs[r][i] if i < len(seqs[r]) else None  # noqa: E731
    i = next((i for i in range(size) if len({_key(at(r, i)) for r in range(len(seqs))}) > 1), None)
    if i is None:
        raise ValueError("the ranks issued the same collectives: no divergence to diagnose")
    here = {r: at(r, i) for r in range(len(seqs))}
    if part == "metric":
        lines = [{e["line"] for e in s} for s in seqs]
        alone = [line for line in set().union(*lines) if line is not None and not all(line in ls for ls in lines)]
        line = min(alone)
        ranks = [r for r, ls in enumerate(lines) if line in ls]
        op = next(e["op"] for s in seqs for e in s if e["line"] == line)
        symptom = {e["line"] for r, e in here.items() if e is not None and r not in ranks}
    elif part == "uneven":
        ranks = [r for r, e in here.items() if e is not None]
        line, op = here[ranks[0]]["line"], here[ranks[0]]["op"]
        symptom = set()
    elif part == "early":
        ranks = [r for r, e in here.items() if e is None]
        line = journals[ranks[0]]["returned_at"]
        waiting = [e for e in here.values() if e is not None]
        op = waiting[0]["op"]
        symptom = {e["line"] for e in waiting}
    else:
        numel = {r: math.prod(sum((list(x) for x in (e["sizes"] or [])), [])) for r, e in here.items()}
        ranks = [r for r, n in numel.items() if n < max(numel.values())]
        line, op = here[0]["line"], here[0]["op"]
        symptom = set()
    return {"ranks": sorted(ranks), "collective": op, "line": line, "symptom_lines": sorted(x for x in symptom if x)}


# --- the diagnosis -----------------------------------------------------------------------------------------


def _ask(rank, diagnose, job):
    return diagnose(dict(job))


def _collective_name(value) -> str:
    text = str(value).strip().lower().replace("torch.distributed.", "").replace("dist.", "")
    return text.split("(")[0].replace("_", "").replace(" ", "")


def _line_matches(value, line: int, lines: list[str]) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value == line
    if isinstance(value, str):
        code = " ".join(value.split())
        if code.isdigit():
            return int(code) == line
        return bool(code) and 0 < line <= len(lines) and " ".join(lines[line - 1].split()).split("#")[0].strip() == code.split("#")[0].strip()
    return False


def check_diagnosis(part: str, diagnose, *, world_size: int, n_train: int, n_val: int, seed: int, classes: int = 3,
                    log_rank: int = 0):
    check = f"check_diagnosis_{part}"
    checks.require_written(check, **{f"diagnose_{part}": diagnose})
    s = _settings(part, world_size, n_train, n_val, seed, classes, log_rank)
    want = truth(tuple(sorted(s.items())))
    job = job_settings(s)
    answer = checks.run(check, _ask, 1, args=(diagnose, job), timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                        expected=f"diagnose_{part}(job) returns a dict with 'ranks', 'collective' and 'line'").values[0]
    if not isinstance(answer, dict) or not {"ranks", "collective", "line"} <= set(answer):
        raise CheckFailed(check, "the diagnosis is not a dict with the keys 'ranks', 'collective' and 'line'",
                          expected="{'ranks': [...], 'collective': '...', 'line': <line number>}",
                          got=repr(answer)[:200], hint=f"return a dict from diagnose_{part}(job)")
    script = hm.SCRIPTS[part][0]
    lines = hm.script_lines(part)
    try:
        ranks = sorted({int(r) for r in (answer["ranks"] if isinstance(answer["ranks"], (list, tuple, set))
                                          else [answer["ranks"]])})
    except (TypeError, ValueError):
        ranks = None
    shown = f"the job: {job if part != 'shapes' else {k: v for k, v in job.items() if k != 'val_labels'}}"
    if ranks != want["ranks"]:
        others = sorted(set(range(s["world_size"])) - set(want["ranks"]))
        why = ("those are the other side of the deadlock" if ranks == others else
               "read the stall report of this job again, and work out who does what with these settings")
        raise CheckFailed(check, f"wrong ranks: the question is {QUESTION[part]}",
                          expected=f"ranks {want['ranks']} ({shown})", got=f"ranks {answer['ranks']!r}",
                          hint=f"{why}; your diagnose_{part}(job) must work out the ranks from the job's settings "
                          "(the hidden tests change them)")
    if _collective_name(answer["collective"]) != _collective_name(want["collective"]):
        raise CheckFailed(check, "wrong collective", expected=f"{want['collective']!r} (the collective the job cannot "
                          "complete)", got=repr(answer["collective"]),
                          hint="the stall report names, for each rank, the collective it waits in; a DDP backward's "
                          "collective is an all_reduce")
    if not _line_matches(answer["line"], want["line"], lines):
        symptom = any(_line_matches(answer["line"], x, lines) for x in want["symptom_lines"])
        raise CheckFailed(check, f"wrong line of {script}: the question is {LINE[part]}",
                          expected=f"line {want['line']}: {lines[want['line'] - 1].strip()}",
                          got=f"{answer['line']!r}",
                          hint=("that is where the other ranks wait: the symptom, not the cause"
                                if symptom else "give the line number in the file (as the stall report shows it)"))
    passed(check)


# --- the fix -----------------------------------------------------------------------------------------------


def _fix_harness(rank, train, fn, folder, s):
    hm.FAILED_BARRIERS.clear()  # this job's barriers only
    dev = checks.join_job()
    world_size = _REAL.get_world_size()
    model = hm.make_model(s["seed"], s["classes"]).to(dev)
    train_set, val_set = _data(s)
    if s["part"] != "uneven":  # this rank's private view: the real features of its own share only
        val_set = ev.take_view(folder, rank, val_set, _REAL.all_reduce, checks.grader_writes)
    logs, forwards = [], []

    def on_forward(module, args):
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            forwards.append(train_set.indices_of(args[0]))  # one batch: the step's samples, in order

    model.register_forward_pre_hook(checks.grader_hook(on_forward))

    def log(metrics, *args, **kwargs):
        values = {}
        for key, value in (metrics.items() if isinstance(metrics, dict) else []):
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().tolist()
            if isinstance(value, (int, float)) or (isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)):
                values[str(key)] = value
        logs.append({"values": values, "state": checks.to_cpu(model.state_dict())})

    out_dir = os.path.join(folder, "out")
    held = []
    if s["part"] == "early" and rank == 0:
        returned = hm.report_rank0(folder)
    else:
        returned = None

    def before(event):  # a rank other than 0 about to write a file in out_dir: only once rank 0 waits for it
        if rank != 0 and os.path.dirname(os.path.abspath(event["path"])) == out_dir and not held:
            held.append(hm.wait_for_rank0(folder, rank, HOLD_LIMIT))

    try:
        with checks.record_writes(before if s["part"] == "early" else None) as writes:
            train(rank, world_size, model, train_set, val_set, log, **_kwargs(s, out_dir),
                  **{hm.SCRIPTS[s["part"]][2]: fn})
    finally:
        if returned is not None:
            returned()
    # collectives only: point-to-point ops pair by peer (monitored_barrier's sends and receives differ by rank)
    issued = [(c["op"], str(c["sizes"])) for c in _REAL.collectives() if not c["p2p"]]
    return {"state": checks.to_cpu(model.state_dict()), "logs": logs, "forwards": forwards, "issued": issued,
            "held": held, "failed": list(hm.FAILED_BARRIERS), "writes": [w["path"] for w in writes]}


def check_fix(part: str, fn, *, world_size: int, n_train: int, n_val: int, seed: int, classes: int = 3,
              log_rank: int = 0):
    check = f"check_fix_{part}"
    checks.require_written(check, **{hm.SCRIPTS[part][2]: fn})
    s = _settings(part, world_size, n_train, n_val, seed, classes, log_rank)
    train_set, val_set = _data(s)
    folder = tempfile.mkdtemp(prefix="ddp-course-hang-fix-")
    try:
        os.makedirs(os.path.join(folder, "out"))
        if part != "uneven":
            val_set = _private_views(part, s, val_set, folder)
        job = checks.run(check, _fix_harness, s["world_size"], args=(hm.load_script(part), fn, folder, s),
                         timeout=min(checks.check_timeout(), JOB_TIMEOUT),
                         hints=[("timeout", "the training still hangs with your function: a timeout, a try/except or "
                                 "a sleep does not make the ranks call the same collectives; remove the cause")])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    obs = job.values
    _no_failed_barrier(check, obs, ev.failed_barriers(job.outputs))
    _same_collectives(check, obs)
    if part == "early":
        _judge_order(check, obs)
    elif part != "uneven":
        _no_files(check, obs)
    if part == "uneven":
        hm.judge_uneven(check, s, obs)
    else:
        _judge_weights(check, s, obs)
        _judge_logs(check, part, s, obs, val_set)
    passed(check)


def _private_views(part, s, val_set, folder):
    """The validation set with secret features (the labels are the part's), each rank's view written for its harness
    (:func:`graders.find_the_hang.evidence.take_view`); the logging rank's view makes a metric computed alone wrong."""
    ref = hm.reference(s["seed"], s["classes"], s["n_train"], s["world_size"], s["batch_size"], s["epochs"], s["lr"])
    real = hm.Samples(0, 0)
    real.y, real.rows = val_set.y, {}

    def shortcut_differs(x, view):
        real.x = x
        alone = hm.Samples(0, 0)
        alone.x, alone.y = view, val_set.y
        if _metric(part, ref, alone, s["classes"]) == _metric(part, ref, real, s["classes"]):
            return False
        return part != "shapes" or _by_prediction_differs(ref, real, s["classes"])

    real.x, views = ev.views(part, s, val_set.y, hm.FEATURES, shortcut_differs)
    ev.write_views(folder, views, val_set.y)
    return real


def _by_prediction_differs(state, data, classes) -> bool:
    """Whether counting per predicted class (not per label) gives another accuracy for some class: one with a right
    prediction whose count of predictions differs from its count of labels. A set where every class is predicted
    as often as it occurs would let that mistake pass, so the secret rows are drawn until this holds."""
    preds = hm.predictions(state, data, classes)
    hits = preds == data.y
    return any(int((hits & (data.y == c)).sum()) > 0 and int((preds == c).sum()) != int((data.y == c).sum())
               for c in range(classes))


def _metric(part, state, data, classes):
    """The part's logged metric of weights ``state`` over ``data``, rounded to what the checks tell apart."""
    if part == "metric":
        return round(hm.val_loss(state, data, classes), 3)
    preds = hm.predictions(state, data, classes)
    if part == "early":
        return int((preds == data.y).sum())
    return [(int(((preds == data.y) & (data.y == c)).sum()), int((data.y == c).sum())) for c in range(classes)]


def _no_files(check, obs):
    for rank, o in enumerate(obs):
        if o["writes"]:
            raise CheckFailed(check, f"rank {rank} wrote a file while it trained and logged", ranks=[rank],
                              expected="the ranks' totals travel by a collective, no file",
                              got=f"it wrote {o['writes'][0]}",
                              hint="fix the collective: every rank takes part in it, and nothing else moves the data")


def _no_failed_barrier(check, obs, seen):
    """``seen``: rank -> what its process group wrote when a barrier failed (the launcher's record of its output);
    ``obs[r]["failed"]``: the barriers that raised in rank r (its own record, which only adds what it caught)."""
    for rank, o in enumerate(obs):
        if rank in seen or o.get("failed"):
            method, error = o["failed"][0] if o.get("failed") else ("monitored_barrier", seen[rank])
            raise CheckFailed(check, f"the job finished, but rank {rank}'s {method} failed and the rank went on",
                              ranks=[rank], expected="every barrier completes on every rank",
                              got=f"{method} raised {error}" if o.get("failed") else f"its process group wrote: {error}",
                              hint="a timeout or a caught exception let a rank go on past a barrier that never "
                              "completed: that hides the hang, it does not remove its cause (a rank that returned "
                              "early never reached it)")


def _same_collectives(check, obs):
    base = obs[0]["issued"]
    for rank, o in enumerate(obs):
        if o["issued"] != base:
            n = next((i for i, (a, b) in enumerate(zip(o["issued"], base)) if a != b), min(len(o["issued"]), len(base)))
            mine = o["issued"][n] if n < len(o["issued"]) else "nothing (it had returned)"
            theirs = base[n] if n < len(base) else "nothing (it had returned)"
            raise CheckFailed(check, f"the job finished, but rank {rank} did not issue the same collectives as rank 0",
                              ranks=[rank], expected="every rank issues the same collectives, in the same order",
                              got=f"collective #{n + 1}: rank 0 issued {theirs}, rank {rank} issued {mine}",
                              hint="a timeout or a caught exception let a rank go on past a collective that never "
                              "completed: that hides the hang, it does not remove its cause")


def _judge_order(check, obs):
    """Rank 0 read the prediction files only once every rank had written its own: each other rank's write was held
    until rank 0 waited in a collective (what makes it wait), so a rank 0 that returned first did not wait for it."""
    early = [rank for rank, o in enumerate(obs) if rank and o["held"] and o["held"][0] != "waiting"]
    if early:
        how = {o["held"][0] for o in (obs[r] for r in early)}
        raise CheckFailed(check, f"rank 0 read the prediction files before {checks.rank_list(early)} had written "
                          "theirs", ranks=early, expected="rank 0 waits until every rank has written its file",
                          got=("rank 0 had already returned when the file was written (the grader's disk is slow: "
                               "a file appears only once rank 0 waits for it)" if how == {"returned"} else
                               f"rank 0 neither waited in a collective nor returned for {HOLD_LIMIT:g} s"),
                          hint="rank 0 must wait for the other ranks' files with something every rank calls once its "
                          "file is written (a sleep is not: no fixed time is long enough on every disk)")


def _judge_weights(check, s, obs):
    want = hm.reference(s["seed"], s["classes"], s["n_train"], s["world_size"], s["batch_size"], s["epochs"], s["lr"])
    for rank, o in enumerate(obs):
        got = o["state"]
        bad = [k for k in want if k not in got or got[k].shape != want[k].shape
               or not torch.allclose(got[k].float(), want[k], atol=ATOL)]
        if bad:
            raise CheckFailed(check, f"rank {rank}'s weights at the end are not those of the given "
                              "training", ranks=[rank],
                              expected="DDP training with the script's sampler, batch size and learning rate "
                              "(computed here in one process)", got=f"{len(bad)} tensors differ, e.g. `{bad[0]}`",
                              hint="fix the hang and nothing else: leave the model's weights alone")


def _logs_of(obs, key):
    return [(rank, e) for rank, o in enumerate(obs) for e in o["logs"] if key in e["values"]]


def _judge_logs(check, part, s, obs, val_set):
    key, logger = {"metric": ("val_loss", s.get("log_rank", 0)), "early": ("val_accuracy", 0),
                   "shapes": ("class_accuracy", 0)}[part]
    logs = _logs_of(obs, key)
    want_n = s["epochs"] if part == "metric" else 1
    others = sorted({r for r, _ in logs if r != logger})
    if others:
        raise CheckFailed(check, f"{checks.rank_list(others)} logged {key!r} too", ranks=others,
                          expected=f"only rank {logger} logs", hint=f"log only when rank == {logger}")
    if len(logs) != want_n:
        raise CheckFailed(check, f"rank {logger} logged {key!r} {len(logs)} times", ranks=[logger],
                          expected=f"{want_n} time(s)",
                          hint="log as the function's docstring says: once per call, on that rank only")
    for _, entry in logs:
        got, state = entry["values"][key], entry["state"]
        if part == "metric":
            want = hm.val_loss(state, val_set, s["classes"])
            if not isinstance(got, (int, float)) or abs(got - want) > ATOL:
                mine = hm.Samples(0, 0)
                share = list(range(logger, s["n_val"], s["world_size"]))
                mine.x, mine.y = val_set.x[share], val_set.y[share]
                local = abs(got - hm.val_loss(state, mine, s["classes"])) <= ATOL if isinstance(got, (int, float)) else False
                raise CheckFailed(check, f"rank {logger} logged a validation loss the model does not have", ranks=[logger],
                                  expected=f"{want:.6f} (over all {s['n_val']} validation samples)", got=repr(got),
                                  hint=(f"it is the loss of rank {logger}'s own share only: the other ranks' totals never "
                                        "reached it (the collective was removed, not fixed)" if local else
                                        "sum every rank's totals (all ranks must take part), then divide"))
        elif part == "early":
            right = int((hm.predictions(state, val_set, s["classes"]) == val_set.y).sum())
            want = right / s["n_val"]
            if not isinstance(got, (int, float)) or abs(got - want) > ATOL:
                raise CheckFailed(check, "rank 0 logged a validation accuracy the model does not have", ranks=[0],
                                  expected=f"{want:.6f} ({right} right of {s['n_val']})", got=repr(got),
                                  hint="merge every rank's predictions, over the whole validation set")
        else:
            preds = hm.predictions(state, val_set, s["classes"])
            want = [float(((preds == val_set.y) & (val_set.y == c)).sum() / (val_set.y == c).sum())
                    for c in range(s["classes"])]
            ok = isinstance(got, list) and len(got) == len(want) and all(abs(a - b) <= ATOL for a, b in zip(got, want))
            if not ok:
                raise CheckFailed(check, "rank 0 logged per-class accuracies the model does not have", ranks=[0],
                                  expected=f"{[round(w, 4) for w in want]} (one per class, over the whole validation set)",
                                  got=repr(got)[:200],
                                  hint=("a number for every class the model has, even one a rank never saw"
                                        if isinstance(got, list) and len(got) != len(want) else
                                        "count, per class, the rank's samples of that class (its labels) and those "
                                        "of them predicted right: the given code sums every rank's counts"))


# --- the notebook's names ------------------------------------------------------------------------------------

_DEFAULTS = {
    "metric": {"world_size": 2, "n_train": 24, "n_val": 11, "seed": 0, "log_rank": 0},
    "uneven": {"world_size": 2, "n_train": 21, "n_val": 11, "seed": 0},
    "early": {"world_size": 3, "n_train": 24, "n_val": 4, "seed": 0},
    "shapes": {"world_size": 2, "n_train": 24, "n_val": 7, "seed": 3},
}


# Written out (not made in a loop) so that their docstrings can be read from the source: tables and feedback pages
# describe each test cell by the docstring of the check it calls (course/instructor/checknames.py).


def check_diagnosis_metric(diagnose, **settings):
    """The diagnosis of hang_metric.py: the rank(s) that call a collective which the other ranks never call, the
    collective, the line that calls it."""
    check_diagnosis("metric", diagnose, **{**_DEFAULTS["metric"], **settings})


def check_fix_metric(fn, **settings):
    """train_metric with the fixed log_val_loss finishes, every rank issues the same collectives, and only log_rank
    logs the validation loss over every validation sample."""
    check_fix("metric", fn, **{**_DEFAULTS["metric"], **settings})


def check_diagnosis_uneven(diagnose, **settings):
    """The diagnosis of hang_uneven.py: the rank(s) left waiting (they run more steps than another rank), the
    collective, the line at which they wait."""
    check_diagnosis("uneven", diagnose, **{**_DEFAULTS["uneven"], **settings})


def check_fix_uneven(fn, **settings):
    """train_uneven with the fixed share_of finishes, every rank issues the same collectives (as many synchronised
    steps), and every epoch trains on every sample."""
    check_fix("uneven", fn, **{**_DEFAULTS["uneven"], **settings})


def check_diagnosis_early(diagnose, **settings):
    """The diagnosis of hang_early.py: the rank(s) that leave the function early, the collective the others wait
    in, the line at which those ranks leave (the cause)."""
    check_diagnosis("early", diagnose, **{**_DEFAULTS["early"], **settings})


def check_fix_early(fn, **settings):
    """train_early with the fixed predict_and_merge finishes, every rank issues the same collectives, rank 0 reads the
    predictions only once every rank has written them, and logs the accuracy over every validation sample."""
    check_fix("early", fn, **{**_DEFAULTS["early"], **settings})


def check_diagnosis_shapes(diagnose, **settings):
    """The diagnosis of hang_shapes.py: the rank(s) whose tensor is smaller than the others' in a collective, the
    collective, its line."""
    check_diagnosis("shapes", diagnose, **{**_DEFAULTS["shapes"], **settings})


def check_fix_shapes(fn, **settings):
    """train_shapes with the fixed class_counts finishes, every rank issues the same collectives, and rank 0 logs one
    accuracy per class over the whole validation set."""
    check_fix("shapes", fn, **{**_DEFAULTS["shapes"], **settings})


def try_it(part: str, fn=None, **settings) -> None:
    """Run ``part``'s script (with ``fn``, your fixed function, in place of the one its training calls) as the checks
    run it, and print what happened: what each rank logged, or why the job did not finish (the launcher's stall
    report for a deadlock)."""
    from course.errors import LaunchError

    if checks.grading():
        print("(try_it runs nothing while the notebook is graded: the checks run the jobs)")
        return
    s = _settings(part, **{**_DEFAULTS[part], **settings})
    folder = tempfile.mkdtemp(prefix="ddp-course-hang-try-")
    try:
        os.makedirs(os.path.join(folder, "out"))
        try:
            job = checks.launch(_fix_harness, s["world_size"],
                         args=(hm.load_script(part), fn or hm.buggy_function(part), folder, s),
                         timeout=JOB_TIMEOUT, echo=True)
        except LaunchError as err:
            print(err)
            return
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for rank, o in enumerate(job.values):
        for entry in o["logs"]:
            print(f"rank {rank} logged {entry['values']}")
    print(f"the {s['world_size']}-rank job finished in {job.elapsed:.1f} s")
