"""Exercise 4's drill, find the hang: the diagnosis is judged against the grader's own run of each script, the fix
by running it.

The four scripts given to students (exercises/ex4-torchrun/hang_*.py) are the source of every fix here: each is a
given training function and the small function it calls, where the bug is, and a fix is that small function edited
(the reference's, fixes in other styles that must pass, and realistic wrong ones that must fail their check with a
message naming the mistake). Diagnoses are small functions of the job's settings, right and wrong.
"""

from __future__ import annotations

import math
import sys
import types

import cloudpickle
import pytest
import submissions

import graders.find_the_hang.checks as hang
from graders.find_the_hang import harness as hm

A = "ex4-torchrun"
NB = "find_the_hang"
fails = submissions.fails
FOLDER = submissions.EXERCISES / A

#: each part's hidden variant, as in the notebook
HIDDEN = {
    "metric": {"world_size": 3, "n_train": 36, "n_val": 13, "seed": 1, "log_rank": 2},
    "uneven": {"world_size": 3, "n_train": 20, "n_val": 9, "seed": 1},
    "early": {"world_size": 4, "n_train": 24, "n_val": 6, "seed": 1},
    "shapes": {"world_size": 3, "n_train": 24, "n_val": 10, "seed": 2, "classes": 4},
}
DIAGNOSIS = {part: getattr(hang, f"check_diagnosis_{part}") for part in hm.SCRIPTS}
FIX = {part: getattr(hang, f"check_fix_{part}") for part in hm.SCRIPTS}


def _module(source: str, name: str) -> types.ModuleType:
    """``source`` as a module the ranks get by value."""
    module = types.ModuleType(f"hang_variant_{name}")
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - our own test code
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    return module


def _buggy(part: str) -> str:
    return (FOLDER / hm.SCRIPTS[part][0]).read_text()


def _edit(source: str, *edits) -> str:
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def _fn(part: str, *edits, name: str = "fix"):
    """The part's script with ``edits`` applied: its small function (the one the student fixes)."""
    return getattr(_module(_edit(_buggy(part), *edits), f"{part}_{name}"), hm.SCRIPTS[part][2])


#: what the notebook's imports cell gives the answer cells
IMPORTS = "import math\n\nfrom graders.find_the_hang.hang_early import merged_accuracy, predict\n"


def _reference_answer(grade_id: str) -> str:
    return "\n".join(line for line in submissions.answer(submissions.load(A, NB), grade_id).splitlines()
                     if "### " not in line)


def _reference(part: str, kind: str):
    """The notebook's reference ``diagnose_<part>`` or fixed function."""
    name = f"diagnose_{part}" if kind == "diagnosis" else hm.SCRIPTS[part][2]
    source = IMPORTS + _reference_answer(f"ex4h_{part}_{kind}")
    return getattr(_module(source, f"{part}_ref_{kind}"), name)


def _diagnose(body: str, part: str, name: str):
    source = f"import math\n\ndef diagnose_{part}(job):\n" + "\n".join("    " + line for line in body.strip().splitlines())
    return getattr(_module(source, f"{part}_diag_{name}"), f"diagnose_{part}")


# --- the scripts --------------------------------------------------------------------------------------------


def test_the_students_scripts_are_the_graders():
    """The grader runs its own copy of each script (the exercise folder is hidden from its sandbox): the student's
    copy must be the same file, or the lines of a diagnosis would not match."""
    for part, (name, *_) in hm.SCRIPTS.items():
        assert (FOLDER / name).read_bytes() == open(hm.script_path(part), "rb").read(), name


def test_derive_reads_each_kind_of_divergence():
    """The truth is read off the journals, whatever the ranks and lines (no run needed)."""
    def e(op, line, sizes=((2,),)):
        return {"op": op, "seq": 0, "sizes": [list(s) for s in sizes], "line": line}

    common = [e("broadcast", 5), e("all_reduce", 9)]
    metric = [{"entries": common + [e("all_reduce", 9)], "returned_at": None},
              {"entries": common + [e("reduce", 12)], "returned_at": None},
              {"entries": common + [e("all_reduce", 9)], "returned_at": None}]
    assert hang.derive("metric", metric) == {"ranks": [1], "collective": "reduce", "line": 12, "symptom_lines": [9]}
    early = [{"entries": common + [e("barrier", 20, ())], "returned_at": None},
             {"entries": common, "returned_at": 17}]
    assert hang.derive("early", early) == {"ranks": [1], "collective": "barrier", "line": 17, "symptom_lines": [20]}
    uneven = [{"entries": common, "returned_at": 30}, {"entries": common + [e("all_reduce", 9)], "returned_at": None}]
    assert hang.derive("uneven", uneven)["ranks"] == [1]
    shapes = [{"entries": common + [e("all_reduce", 40, ((3,),))], "returned_at": None},
              {"entries": common + [e("all_reduce", 40, ((2,),))], "returned_at": None}]
    assert hang.derive("shapes", shapes) == {"ranks": [1], "collective": "all_reduce", "line": 40, "symptom_lines": []}


# --- diagnoses ---------------------------------------------------------------------------------------------

#: per part: name -> None (the reference: it must pass), or (a diagnosis body, the words its failure names or None if it
#: must pass, the settings under which it fails: "visible" or "hidden")
DIAGNOSES = {
    "metric": {
        "reference": None,
        "the line as code, the collective as torch names it": (
            'return {"ranks": [job["log_rank"]], "collective": "dist.reduce", '
            '"line": "dist.reduce(totals, dst=log_rank)"}', None, None),
        "the other side": ('return {"ranks": [r for r in range(job["world_size"]) if r != job["log_rank"]], '
                           '"collective": "reduce", "line": 14}', ["wrong ranks", "the other side of the deadlock"], "visible"),
        "the symptom line": ('return {"ranks": [job["log_rank"]], "collective": "reduce", "line": 33}',
                             ["wrong line", "the symptom, not the cause"], "visible"),
        "the ranks of the notebook's run, hard-coded": ('return {"ranks": [0], "collective": "reduce", "line": 14}',
                                                        ["wrong ranks", "ranks [2]"], "hidden"),
    },
    "uneven": {
        "reference": None,
        "integer arithmetic, the line as code": (
            'ws, n, b = job["world_size"], job["n_train"], job["batch_size"]\n'
            'batches = [-(-((n - r + ws - 1) // ws) // b) for r in range(ws)]\n'
            'return {"ranks": [r for r, k in enumerate(batches) if k != min(batches)], "collective": "allreduce", '
            '"line": "loss.backward()"}', None, None),
        "the ranks that returned": (
            'ws, n, b = job["world_size"], job["n_train"], job["batch_size"]\n'
            'steps = [math.ceil(len(range(r, n, ws)) / b) for r in range(ws)]\n'
            'return {"ranks": [r for r in range(ws) if steps[r] == min(steps)], "collective": "all_reduce", "line": 29}',
            ["wrong ranks", "the other side of the deadlock"], "visible"),
        "the last rank, a guess": ('return {"ranks": [job["world_size"] - 1], "collective": "all_reduce", "line": 29}',
                                   ["wrong ranks", "ranks [0]"], "visible"),
        "a barrier named": ('return {"ranks": [0], "collective": "barrier", "line": 29}', ["wrong collective"], "visible"),
    },
    "early": {
        "reference": None,
        "the empty chunks found with range, the line as code": (
            'ws, n = job["world_size"], job["n_val"]\nsize = -(-n // ws)\n'
            'empty = [r for r in range(ws) if not range(r * size, min(n, (r + 1) * size))]\n'
            'return {"ranks": empty, "collective": "torch.distributed.barrier", "line": "return"}', None, None),
        "the waiting ranks": (
            'ws, n = job["world_size"], job["n_val"]\nchunk = math.ceil(n / ws)\n'
            'return {"ranks": [r for r in range(ws) if r * chunk < n], "collective": "barrier", "line": 20}',
            ["wrong ranks"], "visible"),
        "the barrier's line (the symptom)": (
            'ws, n = job["world_size"], job["n_val"]\nchunk = math.ceil(n / ws)\n'
            'return {"ranks": [r for r in range(ws) if r * chunk >= n], "collective": "barrier", "line": 23}',
            ["wrong line", "the symptom, not the cause", "line 20: return"], "visible"),
    },
    "shapes": {
        "reference": None,
        "the line as a string of digits": (
            'ws, labels = job["world_size"], job["val_labels"]\n'
            'sizes = [max(labels[r::ws]) + 1 for r in range(ws)]\n'
            'return {"ranks": [r for r in range(ws) if sizes[r] < max(sizes)], "collective": "allreduce", "line": "42"}',
            None, None),
        "the bincount line": (
            'ws, labels = job["world_size"], job["val_labels"]\n'
            'sizes = [max(labels[r::ws]) + 1 for r in range(ws)]\n'
            'return {"ranks": [r for r in range(ws) if sizes[r] < max(sizes)], "collective": "all_reduce", "line": 15}',
            ["wrong line", "line 42"], "visible"),
        "the ranks with the larger tensor": (
            'ws, labels = job["world_size"], job["val_labels"]\n'
            'sizes = [max(labels[r::ws]) + 1 for r in range(ws)]\n'
            'return {"ranks": [r for r in range(ws) if sizes[r] == max(sizes)], "collective": "all_reduce", "line": 42}',
            ["wrong ranks"], "visible"),
        "not a dict": ('return ([1], "all_reduce", 42)', ["not a dict"], "visible"),
    },
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", list(hm.SCRIPTS))
def test_diagnoses(part):
    """The reference's and other right diagnoses pass with the notebook's and the hidden settings; each wrong one
    fails, naming what is wrong (a hard-coded answer is right for the notebook's run and wrong for the hidden one).
    The script runs once per settings (the truth is cached)."""
    check = DIAGNOSIS[part]
    for name, case in DIAGNOSES[part].items():
        if case is None:
            diagnose, words, where = _reference(part, "diagnosis"), None, None
        else:
            body, words, where = case
            diagnose = _diagnose(body, part, name.replace(" ", "_").replace("'", "").replace(",", ""))
        if words is None:
            check(diagnose)
            check(diagnose, **HIDDEN[part])
        elif where == "hidden":
            check(diagnose)
            fails(check, diagnose, *words, **HIDDEN[part])
        else:
            fails(check, diagnose, *words)


# --- fixes -------------------------------------------------------------------------------------------------

METRIC_IF = ("    if rank == log_rank:\n        dist.reduce(totals, dst=log_rank)  # the totals of all ranks, "
             "summed on the logging rank\n")
UNEVEN_SHARE = "    return list(range(rank, n, world_size))  # each sample on exactly one rank\n"
EARLY_RETURN = "    if len(mine) == 0:\n        return  # nothing to predict on this rank\n"
EARLY_SAVE = ('    preds = predict(model, val_set, mine)\n'
              '    torch.save({"indices": list(mine), "preds": preds}, os.path.join(out_dir, f"preds{rank}.pt"))\n')
EARLY_PREDICT = "    preds = predict(model, val_set, mine)\n"
EVERY_RANK_WRITES = [(EARLY_RETURN, ""), (EARLY_PREDICT, "    preds = predict(model, val_set, mine) if len(mine) else "
                                                         "torch.zeros(0, dtype=torch.long)\n")]
EARLY_BARRIER = "    dist.barrier()  # every rank's file is complete before rank 0 reads them\n"
SHAPES_COUNTS = ("    seen = torch.bincount(y).float()  # per class: this rank's samples\n"
                 "    right = torch.bincount(y, weights=hits)  # per class: those predicted right\n")

#: per part: name -> (edits of the given script's small function, None if it must pass, else the words its failure
#: names)
FIXES = {
    "metric": {
        "every rank all-reduces, the logging rank logs": (
            [(METRIC_IF, "    dist.all_reduce(totals)\n    if rank == log_rank:\n")], None),
        "all_gather_object of the totals": (
            [(METRIC_IF, "    everyone = [None] * world_size\n"
                         "    dist.all_gather_object(everyone, totals.tolist())\n"
                         "    totals = torch.tensor([sum(t[0] for t in everyone), sum(t[1] for t in everyone)])\n"
                         "    if rank == log_rank:\n")], None),
        "the reduce removed": ([(METRIC_IF, "    if rank == log_rank:\n")],
                               ["logged a validation loss the model does not have", "own share only",
                                "the collective was removed"]),
        "every rank logs": ([(METRIC_IF, "    dist.reduce(totals, dst=log_rank)\n    if True:\n")],
                            ["logged 'val_loss' too", "only rank"]),
        "a timeout caught on the logging rank": (
            [("import torch\n", "from datetime import timedelta\n\nimport torch\n"),
             (METRIC_IF, "    if rank == log_rank:\n"
                         "        work = dist.reduce(totals, dst=log_rank, async_op=True)\n"
                         "        try:\n            work.wait(timeout=timedelta(seconds=1))\n"
                         "        except RuntimeError:\n            pass\n")],
            []),
    },
    "uneven": {
        "each share padded with its own first samples": (
            [(UNEVEN_SHARE, "    ids = list(range(rank, n, world_size))\n"
                            "    longest = -(-n // world_size)\n"
                            "    return ids + ids[:longest - len(ids)]\n")], None),
        "a DistributedSampler's indices": (
            [("from torch.utils.data import DataLoader, Subset\n",
              "from torch.utils.data import DataLoader, DistributedSampler, Subset\n"),
             (UNEVEN_SHARE, "    return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, "
                            "shuffle=False))\n")], None),
        "the shares cut to the shortest (what drop_last does to batches)": (
            [(UNEVEN_SHARE, "    return list(range(rank, n, world_size))[:n // world_size]\n")],
            ["trained on fewer than", "left out of the shares", "every sample counts"]),
        "contiguous chunks, the last one shorter": (
            [(UNEVEN_SHARE, "    chunk = -(-n // world_size)\n"
                            "    return list(range(rank * chunk, min(n, (rank + 1) * chunk)))\n")],
            ["deadlocked", "still hangs"]),
    },
    "early": {
        "every rank writes a file, an empty one too": (EVERY_RANK_WRITES, None),
        "an all_reduce instead of the barrier, the return made a skip": (
            [(EARLY_RETURN + EARLY_SAVE,
              "    if len(mine) > 0:\n" + "".join("    " + line + "\n" for line in EARLY_SAVE.splitlines())),
             (EARLY_BARRIER, "    flag = torch.ones(1, device=next(model.parameters()).device)\n"
                             "    dist.all_reduce(flag)  # everyone has written\n")],
            None),
        "every rank writes a file, then a monitored_barrier": (
            EVERY_RANK_WRITES + [(EARLY_BARRIER, "    dist.monitored_barrier()\n")], None),
        "the barrier removed": ([(EARLY_BARRIER, "")],
                                ["rank 0 read the prediction files before rank 1 had written", "already returned"]),
        "a sleep instead of the barrier": ([("import torch\n", "import time\n\nimport torch\n"),
                                            (EARLY_BARRIER, "    time.sleep(1)  # long enough for the others to write?\n")],
                                           ["rank 0 read the prediction files before", "a sleep is not"]),
        "a barrier with a timeout, its error caught": (
            [("import torch\n", "from datetime import timedelta\n\nimport torch\n"),
             (EARLY_BARRIER, "    try:\n        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=1))\n"
                             "    except RuntimeError:\n        pass\n")],
            ["did not issue the same collectives", "hides the hang"]),
        "the early return kept, a monitored_barrier with a timeout, its error caught": (
            [("import torch\n", "from datetime import timedelta\n\nimport torch\n"),
             (EARLY_BARRIER, "    try:\n        dist.monitored_barrier(timeout=timedelta(seconds=1))\n"
                             "    except RuntimeError:\n        pass\n")],
            ["monitored_barrier failed and the rank went on", "hides the hang"]),
    },
    "shapes": {
        "one_hot sums": ([(SHAPES_COUNTS, "    onehot = F.one_hot(y, logits.shape[1]).float()\n"
                                          "    seen = onehot.sum(dim=0)\n    right = (onehot * hits[:, None]).sum(dim=0)\n")],
                         None),
        "padded to the longest over the ranks": (
            [(SHAPES_COUNTS, SHAPES_COUNTS + "    size = torch.tensor(len(seen))\n"
                                             "    dist.all_reduce(size, op=dist.ReduceOp.MAX)\n"
                                             "    seen = F.pad(seen, (0, int(size) - len(seen)))\n"
                                             "    right = F.pad(right, (0, int(size) - len(right)))\n")], None),
        "counted per predicted class, not per label": (
            [(SHAPES_COUNTS, "    preds = logits.argmax(dim=1)\n"
                             "    seen = torch.bincount(preds, minlength=logits.shape[1]).float()\n"
                             "    right = torch.bincount(preds, weights=hits, minlength=logits.shape[1])\n")],
            ["per-class accuracies the model does not have", "labels"]),
        "minlength=3 written in": ([(SHAPES_COUNTS, "    seen = torch.bincount(y, minlength=3).float()\n"
                                                    "    right = torch.bincount(y, weights=hits, minlength=3)\n")],
                                   []),
    },
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", list(hm.SCRIPTS))
def test_fixes(part):
    """The reference's fix and fixes in other styles pass with the notebook's and the hidden settings; each wrong fix
    fails (with either settings), naming what the job did."""
    check = FIX[part]
    check(_reference(part, "fix"))
    check(_reference(part, "fix"), **HIDDEN[part])
    for name, (edits, words) in FIXES[part].items():
        fn = _fn(part, *edits, name=name.replace(" ", "_").replace("/", "_").replace("'", ""))
        if words is None:
            check(fn)
            check(fn, **HIDDEN[part])
            continue
        try:
            check(fn)
        except Exception:  # noqa: BLE001 - judged below with its message
            fails(check, fn, *words)
        else:
            fails(check, fn, *words, **HIDDEN[part])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_given_scripts_fail_their_fix_checks():
    """Unchanged, each script hangs, and its fix check says so in a few seconds (the stall report, not the deadline)."""
    for part in ("metric", "shapes"):  # (the others' given scripts hang the same way: see test_fixes' wrong fixes)
        message = fails(FIX[part], hm.buggy_function(part), "deadlocked", "still hangs")
        assert hm.SCRIPTS[part][0] in message, message


# --- the notebook ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    submissions.assert_reference_full_marks(A, NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    submissions.assert_untouched_scores_zero(A, tmp_path, NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wrong_answers_lose_exactly_their_cells(tmp_path):
    """Four realistic mistakes in one submission: exactly their four cells lose their points, each naming it."""
    nb = submissions.load(A, NB)
    nb = submissions.patch_answer(nb, "ex4h_metric_diagnosis", '"line": 14', '"line": 33')  # the symptom line
    nb = submissions.patch_answer(nb, "ex4h_uneven_fix", "return padded[rank::world_size]",
                                  "return padded[rank::world_size][:n // world_size]")  # the padding cut off again
    nb = submissions.patch_answer(nb, "ex4h_early_fix", EARLY_BARRIER, "")
    nb = submissions.patch_answer(nb, "ex4h_shapes_fix", "torch.bincount(y, ", "torch.bincount(logits.argmax(dim=1), ",
                                  count=2)  # counted per predicted class
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    got = submissions.messages(report)
    failing = ["ex4h_test_metric_diagnosis", "ex4h_test_uneven_fix", "ex4h_test_early_fix", "ex4h_test_shapes_fix"]
    assert submissions.scores(report) == submissions.losing(A, *failing, notebook=NB), got
    assert "the symptom, not the cause" in got["ex4h_test_metric_diagnosis"]
    assert "every sample counts" in got["ex4h_test_uneven_fix"]
    assert "read the prediction files before" in got["ex4h_test_early_fix"]  # whatever the accuracy happened to be
    assert "per-class accuracies the model does not have" in got["ex4h_test_shapes_fix"]


def test_the_points_add_up():
    assert sum(submissions.full_marks(A, NB).values()) == 16
    assert math.isclose(sum(v for k, v in submissions.full_marks(A, NB).items() if "diagnosis" in k), 5)


# --- forgeries: what a student who read graders/ might try -----------------------------------------------------

TIMEDELTA = ("import torch\n", "import importlib\nimport sys\nfrom datetime import timedelta\n\nimport torch\n")
#: the early return kept; a monitored_barrier whose timeout is caught lets rank 0 go on without the empty rank
CAUGHT = ("    try:\n        dist.monitored_barrier(timeout=timedelta(seconds=1))\n"
          "    except RuntimeError:\n")

#: per part: name -> (edits of the given script's small function, the words its failure names). Each scored full
#: marks on its check before the evidence they fake was moved out of their reach (see the commit that added them).
FORGERIES = {
    "early": {
        "a caught monitored_barrier timeout, the grader's FAILED_BARRIERS cleared": (
            [TIMEDELTA, (EARLY_BARRIER, CAUGHT + "        import graders.find_the_hang.harness as hm\n"
                                        "        hm.FAILED_BARRIERS.clear()\n")],
            ["monitored_barrier", "failed", "hides the hang"]),
        "a caught monitored_barrier timeout, graders.find_the_hang.harness reloaded": (
            [TIMEDELTA, (EARLY_BARRIER, CAUGHT + "        import graders.find_the_hang.harness as hm\n"
                                        "        importlib.reload(hm)\n")],
            ["monitored_barrier", "failed", "hides the hang"]),
        "a caught monitored_barrier timeout, ProcessGroup's wrapper unwrapped through its defaults": (
            [TIMEDELTA, (EARLY_BARRIER, "    from torch._C._distributed_c10d import ProcessGroup\n"
                                        "    for name in ('monitored_barrier', 'barrier'):\n"
                                        "        method = getattr(ProcessGroup, name)\n"
                                        "        real = (getattr(method, '__kwdefaults__', None) or {}).get('_real')\n"
                                        "        if real is not None:\n"
                                        "            setattr(ProcessGroup, name, lambda self, *a, _r=real, **k: _r(self, *a, **k))\n"
                                        + CAUGHT + "        pass\n")],
            ["monitored_barrier", "failed", "hides the hang"]),
        "no barrier: rank 0 sleeps in code compiled under torch's distributed_c10d.py": (
            [TIMEDELTA, (EARLY_BARRIER, "    if rank == 0:\n"
                                        "        fake = {}\n"
                                        "        exec(compile('import time\\ndef barrier(group=None):\\n"
                                        "    time.sleep(1.5)\\n', dist.distributed_c10d.__file__, 'exec'), fake)\n"
                                        "        fake['barrier']()\n")],
            ["rank 0 read the prediction files before", "already returned"]),
        "rank 0 predicts the whole validation set itself, no file, no barrier": (
            [(EARLY_RETURN + EARLY_SAVE + EARLY_BARRIER,
              "    if rank == 0:\n"
              "        preds = predict(model, val_set, range(len(val_set)))\n"
              "        right = sum(int(p) == int(val_set[i][1]) for i, p in enumerate(preds))\n"
              "        log({'val_accuracy': right / len(val_set)})\n"
              "    return\n")],
            ["validation accuracy the model does not have"]),
    },
    "uneven": {
        "the shares cut to the shortest, every sample fed to the grader's forward hook by hand": (
            [(UNEVEN_SHARE, "    import sys\n"
                            "    caller = sys._getframe(1).f_locals\n"
                            "    model, train_set = caller['model'], caller['train_set']\n"
                            "    x = torch.stack([train_set[i][0] for i in range(n)])\n"
                            "    with torch.enable_grad():\n"
                            "        for hook in list(model._forward_pre_hooks.values()):\n"
                            "            for _ in range(caller['epochs']):\n"
                            "                hook(model, (x,))\n"
                            "    return list(range(rank, n, world_size))[:n // world_size]\n")],
            ["not those of training on the batches", "forward"]),
    },
    "metric": {
        "the loss over the whole validation set, from the caller's frame, no collective": (
            [(METRIC_IF, "    if rank == log_rank:\n"
                         "        import sys\n"
                         "        import torch.nn.functional as F\n"
                         "        caller = sys._getframe(1).f_locals\n"
                         "        model, val_set = caller['model'], caller['val_set']\n"
                         "        x = torch.stack([val_set[i][0] for i in range(len(val_set))])\n"
                         "        y = torch.stack([val_set[i][1] for i in range(len(val_set))])\n"
                         "        with torch.no_grad():\n"
                         "            totals = torch.stack([F.cross_entropy(model(x), y, reduction='sum'), "
                         "torch.tensor(float(len(y)))])\n")],
            ["validation loss the model does not have"]),
        "the other ranks' totals through files in the harness's folder, no collective": (
            [(METRIC_IF, "    import os, sys, time\n"
                         "    folder = sys._getframe(2).f_locals['folder']\n"
                         "    if rank != log_rank:\n"
                         "        torch.save(totals, os.path.join(folder, f'totals{epoch}-{rank}.pt'))\n"
                         "    else:\n"
                         "        for other in range(world_size):\n"
                         "            path = os.path.join(folder, f'totals{epoch}-{other}.pt')\n"
                         "            while other != rank and not os.path.exists(path):\n"
                         "                time.sleep(0.01)\n"
                         "            if other != rank:\n"
                         "                time.sleep(0.1)\n"
                         "                totals = totals + torch.load(path)\n"
                         "    if rank == log_rank:\n")],
            ["wrote a file", "collective"]),
    },
    "shapes": {
        "rank 0 counts the whole validation set from its callers' frames, the others send zeros": (
            [(SHAPES_COUNTS, "    import sys\n"
                             "    caller = sys._getframe(1).f_locals\n"
                             "    classes = logits.shape[1]\n"
                             "    if caller['rank'] == 0:\n"
                             "        val_set, model = caller['val_set'], caller['model']\n"
                             "        x = torch.stack([val_set[i][0] for i in range(len(val_set))])\n"
                             "        y = torch.stack([val_set[i][1] for i in range(len(val_set))])\n"
                             "        hits = (model(x).argmax(dim=1) == y).float()\n"
                             "    else:\n"
                             "        y, hits = y[:0], hits[:0]\n"
                             "    seen = torch.bincount(y, minlength=classes).float()\n"
                             "    right = torch.bincount(y, weights=hits, minlength=classes).float()\n")],
            ["per-class accuracies the model does not have"]),
    },
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", list(FORGERIES))
def test_forgeries_fail(part):
    """Each forgery fails its fix check, naming what it hid, with the notebook's and the hidden settings; and the
    part's other cell, its diagnosis, keeps its points: after each forged fix was graded in this process, the
    reference diagnosis still passes with both settings (it is judged on the grader's own run of the given script,
    never on the fix, so nothing a forged fix does in its ranks or leaves in the grader's process may reach it)."""
    diagnose = _reference(part, "diagnosis")
    for name, (edits, words) in FORGERIES[part].items():
        fn = _fn(part, *edits, name="forged_" + "".join(c if c.isalnum() else "_" for c in name)[:60])
        fails(FIX[part], fn, *words)
        fails(FIX[part], fn, *words, **HIDDEN[part])
        DIAGNOSIS[part](diagnose)
        DIAGNOSIS[part](diagnose, **HIDDEN[part])


@pytest.mark.parametrize("settings", [hang._DEFAULTS["shapes"], HIDDEN["shapes"]], ids=["visible", "hidden"])
def test_the_secret_validation_rows_always_tell_counts_per_prediction_from_counts_per_label(settings, tmp_path):
    """On a few secret rows (7 over 3 classes) a model may predict each class exactly as often as it occurs: then
    accuracies counted per predicted class equal those per label, and that wrong fix of class_counts passed now
    and then. Every draw of the rows must tell the two apart (25 draws, each setting)."""
    s = hang._settings("shapes", **settings)
    ref = hm.reference(s["seed"], s["classes"], s["n_train"], s["world_size"], s["batch_size"], s["epochs"], s["lr"])
    for draw in range(25):
        val_set = hang._data(s)[1]
        real = hang._private_views("shapes", s, val_set, str(tmp_path))
        preds = hm.predictions(ref, real, s["classes"])
        hits = (preds == real.y).float()
        right = [float(hits[real.y == c].sum()) for c in range(s["classes"])]
        per_label = [right[c] / max(int((real.y == c).sum()), 1) for c in range(s["classes"])]
        per_prediction = [right[c] / max(int((preds == c).sum()), 1) for c in range(s["classes"])]
        assert per_label != per_prediction, (draw, preds.tolist(), real.y.tolist())
