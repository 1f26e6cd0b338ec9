"""Exercise 2's fourth notebook (debug_training): each bug fixed is graded on its own, by what the job did.

The script given to students (exercises/ex2-ddp-basics/buggy_training.py) is the source of every
variant here: the four fixes applied one by one, other correct ways to fix each bug, and wrong fixes.
Each must pass exactly the checks of the bugs it fixes, with messages that name the symptom.
"""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path

import cloudpickle
import pytest
import submissions

import graders.debug_training.checks as ex2d

A = "ex2-ddp-basics"
NB = "debug_training"
BUGGY = (Path(submissions.EXERCISES) / A / "buggy_training.py").read_text()
HIDDEN = {"world_size": 3, "n_train": 30, "n_val": 13, "seed": 1}
CHECKS = {"shuffle": ex2d.check_shuffle, "metric": ex2d.check_metric, "checkpoint": ex2d.check_checkpoint,
          "finishes": ex2d.check_finishes}

fails = submissions.fails

# each bug's fix: (old text of the given script, new text)
FIX = {
    "shuffle": ("        ddp_model.train()\n", "        sampler.set_epoch(epoch)\n        ddp_model.train()\n"),
    "metric": ("    accuracy = torch.tensor([correct / len(share)], device=device)\n    dist.all_reduce(accuracy)\n"
               "    return accuracy.item() / world_size",
               "    counts = torch.tensor([float(correct), float(len(share))], device=device)\n"
               "    dist.all_reduce(counts)\n    return (counts[0] / counts[1]).item()"),
    "checkpoint": ('"model": ddp_model.state_dict()}', '"model": ddp_model.module.state_dict()}'),
    "finishes": ("        dist.barrier()  # the other ranks", "    dist.barrier()  # the other ranks"),
}

# other right fixes of the same bugs
OTHER_FIX = {
    "shuffle": ("    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)\n\n    for epoch in range(epochs):\n",
                "\n    for epoch in range(epochs):\n        sampler = DistributedSampler(train_set, num_replicas=world_size, "
                "rank=rank, seed=1000 + epoch)\n        loader = DataLoader(train_set, batch_size=batch_size, "
                "sampler=sampler)\n"),
    "metric": ("    accuracy = torch.tensor([correct / len(share)], device=device)\n    dist.all_reduce(accuracy)\n"
               "    return accuracy.item() / world_size",
               "    everyone = [None] * world_size\n    dist.all_gather_object(everyone, (correct, len(share)))\n"
               "    return sum(c for c, _ in everyone) / sum(n for _, n in everyone)"),
    "checkpoint": ('"model": ddp_model.state_dict()}, ckpt_path)',
                   '"model": {k.removeprefix("module."): v for k, v in ddp_model.state_dict().items()}}, ckpt_path)'),
    "finishes": ("        dist.barrier()  # the other ranks must not go on before the checkpoint is written",
                 "    flag = torch.ones(1)\n    dist.all_reduce(flag)  # every rank waits for rank 0's save"),
}

# wrong fixes: (an edit or a tuple of edits, the check that must fail, words in its message)
WRONG_FIX = {
    "set_epoch with a constant": (("        ddp_model.train()\n", "        sampler.set_epoch(7)\n        ddp_model.train()\n"),
                                  "shuffle", ["the same samples in the same order"]),
    "a shuffle per rank": (("        ddp_model.train()\n", "        sampler.set_epoch(epoch + rank)\n        ddp_model.train()\n"),
                           "shuffle", ["never trained on"]),
    "the barrier removed": (("        dist.barrier()  # the other ranks must not go on before the checkpoint is written\n",
                             ""), "finishes", ["returned from main before the checkpoint was complete"]),
    "a 2 s sleep instead of the barrier": (
        (("import torch\n", "import time\nimport torch\n"),
         ("        dist.barrier()  # the other ranks must not go on before the checkpoint is written\n",
          "    time.sleep(2)  # long enough for the save?\n")),
        "finishes", ["returned from main before the checkpoint was complete"]),
    "a 10 s sleep instead of the barrier": (
        (("import torch\n", "import time\nimport torch\n"),
         ("        dist.barrier()  # the other ranks must not go on before the checkpoint is written\n",
          "    time.sleep(10)  # long enough for the save?\n")),
        "finishes", ["rank 1 did not wait for rank 0's checkpoint", "neither waited in a collective nor returned",
                     "still running its own code, at line", "a sleep is not"]),
    "the barrier removed, torch.save bound at the top": (
        (("import torch\n", "import torch\nfrom torch import save\n"), ("        torch.save({", "        save({"),
         ("        dist.barrier()  # the other ranks must not go on before the checkpoint is written\n", "")),
        "finishes", ["returned from main before the checkpoint was complete"]),
    "rank 0's share only": (("    dist.all_reduce(accuracy)\n    return accuracy.item() / world_size",
                             "    return accuracy.item()"), "metric", ["logged an accuracy the model does not have"]),
    "the initial weights saved": ((('"model": ddp_model.state_dict()}', '"model": initial}'),
                                   ("    device = next(model.parameters()).device\n",
                                    "    device = next(model.parameters()).device\n"
                                    "    initial = {k: v.clone() for k, v in model.state_dict().items()}\n")),
                                  "checkpoint", ["does not hold the trained weights"]),
}


_LOG_CALL = '        if rank == 0:\n            log({"epoch": epoch, "accuracy": accuracy})\n'
_SAVE_GUARD = '    if rank == 0:\n        torch.save({'

# the four bugs fixed, then a rule of the course broken: (edits, the checks that must fail, words in the first's message)
RULE_BREAKS = {
    "every rank logs": (((_LOG_CALL, '        log({"epoch": epoch, "accuracy": accuracy})\n'),),
                        ["metric"], ["rank 1 also logged", "only rank 0 logs", "called log(", "`if rank == 0:`"]),
    "every rank prints the accuracy": (
        ((_LOG_CALL, _LOG_CALL + '        print(f"epoch {epoch}: accuracy {accuracy:.3f}")\n'),),
        ["metric"], ["only rank 0 logs", 'printed "epoch 0: accuracy']),
    "every rank logs through logging": (
        (("import torch\n", "import logging\n\nimport torch\n"),
         (_LOG_CALL, _LOG_CALL + '        logging.warning("epoch %d: accuracy %.3f", epoch, accuracy)\n')),
        ["metric"], ["only rank 0 logs", 'logged "WARNING: epoch 0: accuracy']),
    "every rank prints to stderr": (
        (("import torch\n", "import sys\n\nimport torch\n"),
         (_LOG_CALL, _LOG_CALL + '        print("epoch", epoch, "done", file=sys.stderr)\n')),
        ["metric"], ["only rank 0 logs", 'printed "epoch 0 done"']),
    "every rank saves": (((_SAVE_GUARD, '    if True:  # every rank\n        torch.save({'),),
                         ["checkpoint"], ["also wrote the checkpoint: only rank 0 saves", "ckpt.pt", "`if rank == 0:`"]),
    "the other ranks keep copies beside it": (
        (("    dist.barrier()  # the other ranks", "    if rank != 0:  # a spare copy, just in case\n"
          '        torch.save(ddp_model.module.state_dict(), f"{ckpt_path}.rank{rank}")\n'
          "    dist.barrier()  # the other ranks"),),
        ["checkpoint"], ["rank 1 also wrote a file: only rank 0 saves", "ckpt.pt.rank1"]),
    "every rank logs and saves": (((_LOG_CALL, '        log({"epoch": epoch, "accuracy": accuracy})\n'),
                                   (_SAVE_GUARD, '    if True:  # every rank\n        torch.save({')),
                                  ["metric", "checkpoint"], ["only rank 0 logs"]),
}

# the four bugs fixed, then part of the work left undone (each a survivor of a mutation run over graders/debug_training/checks.py:
# no test made it before): the check that sees it fails with its own message, the others pass
_SAVE = '        torch.save({"epoch": epochs, "model": ddp_model.module.state_dict()}, ckpt_path)\n'
UNDONE_WORK = {
    "one batch per epoch": ((("        optimizer.step()\n", "        optimizer.step()\n        break  # enough to see it learn\n"),),
                            ["shuffle"], ["rank 0's model was trained on 12 samples in 3 epochs", "whole share"]),
    "the accuracy logged once, after training": (
        ((_LOG_CALL, ""), (_SAVE_GUARD, '    if rank == 0:\n        log({"epoch": epochs - 1, "accuracy": accuracy})\n'
                                        "        torch.save({")),
        ["metric"], ["the script logged 1 accuracies in 3 epochs", "after every epoch"]),
    "the accuracy under another key": (((_LOG_CALL, '        if rank == 0:\n            log({"epoch": epoch, "acc": accuracy})\n'),),
                                       ["metric"], ["the script logged 0 accuracies in 3 epochs",
                                                    "log calls with the keys ['acc', 'epoch']", "the key 'accuracy'"]),
    "the checkpoint saved under another name": (
        ((_SAVE, '        torch.save({"epoch": epochs, "model": ddp_model.module.state_dict()},\n'
                 '                   ckpt_path.replace(".pt", "-final.pt"))\n'),),
        ["checkpoint"], ["there is no checkpoint at ckpt_path", "save to ckpt_path"]),
    "the whole model pickled": (((_SAVE, "        torch.save(ddp_model.module, ckpt_path)\n"),),
                                ["checkpoint"], ["the checkpoint cannot be read back", "save plain data"]),
}

# the four bugs fixed, and logging as the rules allow: all checks pass
RULE_KEEPING = {
    "rank 0 prints and logs through logging": (
        ("import torch\n", "import logging\n\nimport torch\n"),
        (_LOG_CALL, _LOG_CALL + '            print(f"epoch {epoch}: accuracy {accuracy:.3f}")\n'
                                '            logging.warning("epoch %d done", epoch)\n'
                                '        warnings.warn("a warning is not a log line")  # every rank: Python\'s, not logging\n'),
        ("import logging\n", "import logging\nimport warnings\n")),
    "rank 0 also logs the training loss, in a log call of its own": (
        (_LOG_CALL, _LOG_CALL + '            log({"epoch": epoch, "train_loss": 0.5})\n'),),
    "rank 0 saves through a temporary file": (
        ("import torch\n", "import os\n\nimport torch\n"),
        ('        torch.save({"epoch": epochs, "model": ddp_model.module.state_dict()}, ckpt_path)\n',
         '        torch.save({"epoch": epochs, "model": ddp_model.module.state_dict()}, ckpt_path + ".tmp")\n'
         '        os.replace(ckpt_path + ".tmp", ckpt_path)\n')),
}


def _script(source: str, name: str):
    """``main`` of a script variant, as a module the ranks get by value."""
    module = types.ModuleType(f"debug_variant_{name}")
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - our own test scripts
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    return module.main


def _edit(source: str, *edits) -> str:
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def _fixed(*bugs, other=()):
    return _edit(BUGGY, *(FIX[b] for b in bugs), *(OTHER_FIX[b] for b in other))


def test_the_given_script_is_the_solution_with_four_bugs():
    """The reference solution in the notebook is the given script with exactly the four fixes."""
    nb = submissions.load(A, NB)
    solution = submissions.answer(nb, "ex2d_script")
    body = "\n".join(line for line in solution.splitlines() if "### " not in line)
    fixed = _fixed(*FIX).replace("sampler.set_epoch(epoch)\n", "sampler.set_epoch(epoch)  # a new shuffle every "
                                 "epoch, the same on every rank\n").replace(
        "    dist.all_reduce(counts)\n", "    dist.all_reduce(counts)  # the totals over all ranks\n")
    code = "\n".join(line for line in fixed.splitlines() if not line.startswith("#")).strip()
    assert code == body.strip()


def test_the_validation_shares_differ_in_size():
    """For the sizes the tests use, the ranks' validation shares differ in size: what makes the mean of per-rank
    accuracies differ from the accuracy (test_the_given_script_fails_with_the_symptoms shows it does)."""
    for n_val, world_size in [(11, 2), (13, 3)]:
        assert len({len(range(r, n_val, world_size)) for r in range(world_size)}) > 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_fix_is_graded_on_its_own():
    """The given script fails all four checks; with any one bug fixed, exactly that check passes."""
    for bug in [None, *FIX]:
        main = _script(_fixed(bug) if bug else BUGGY, f"only_{bug}")
        for name, check in CHECKS.items():
            if name == bug:
                check(main)
            else:
                fails(check, main)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_given_script_fails_with_the_symptoms():
    main = _script(BUGGY, "buggy")
    fails(ex2d.check_shuffle, main, "epochs 1 and 2 fed rank 0's model the same samples in the same order",
          "repeats the first one's order")
    fails(ex2d.check_metric, main, "logged an accuracy the model does not have", "mean of the ranks' own accuracies",
          "check_finishes says why")
    fails(ex2d.check_checkpoint, main, "does not load into the model without DDP", "Unexpected key(s)", "module.0.weight",
          "wrapper's prefix")
    fails(ex2d.check_finishes, main, "deadlocked", "rank 0 waits in barrier", "rank 1 had returned",
          "a collective runs only when every rank calls it")
    for check in CHECKS.values():
        fails(check, main, **HIDDEN)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_other_right_fixes_pass():
    main = _script(_fixed(other=list(OTHER_FIX)), "other_fixes")
    for check in CHECKS.values():
        check(main)
        check(main, **HIDDEN)
    # and the fixes mixed with the reference's
    for mix in itertools.islice(itertools.combinations(FIX, 2), 2):
        main = _script(_fixed(*mix, other=[b for b in FIX if b not in mix]), f"mix_{'_'.join(mix)}")
        for check in CHECKS.values():
            check(main)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_save_bound_before_the_job_is_seen():
    """`from torch import save` at the script's top: bound before the grader's job, still seen and held."""
    bound = _edit(_fixed(*FIX), ("import torch\n", "import torch\nfrom torch import save\n"),
                  ("        torch.save({", "        save({"))
    main = _script(bound, "bound_save")
    for check in CHECKS.values():
        check(main)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(WRONG_FIX))
def test_wrong_fixes_fail_their_check(name):
    edits, failing, words = WRONG_FIX[name]
    edits = edits if isinstance(edits[0], tuple) else (edits,)
    bugs = [b for b in FIX if b != failing]
    main = _script(_edit(_fixed(*bugs), *edits), name.replace(" ", "_").replace("'", ""))
    for check_name, check in CHECKS.items():
        if check_name == failing:
            fails(check, main, *words)
        else:
            check(main)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RULE_BREAKS))
def test_a_fix_that_breaks_the_rank0_rules_loses_that_check(name):
    """The planted bugs fixed, but every rank logs (the log function, print, logging) or saves: check_metric or
    check_checkpoint fails, naming the rule and the rank; the other checks pass."""
    edits, failing, words = RULE_BREAKS[name]
    main = _script(_edit(_fixed(*FIX), *edits), "rules_" + name.replace(" ", "_"))
    for check_name, check in CHECKS.items():
        if check_name in failing:
            fails(check, main, *(words if check_name == failing[0] else ()))
        else:
            check(main)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(UNDONE_WORK))
def test_work_left_undone_loses_exactly_the_check_that_sees_it(name):
    edits, failing, words = UNDONE_WORK[name]
    main = _script(_edit(_fixed(*FIX), *edits), "undone_" + name.replace(" ", "_").replace(",", ""))
    for check_name, check in CHECKS.items():
        if check_name in failing:
            fails(check, main, *words)
        else:
            check(main)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_logging_and_saving_on_rank0_as_the_rules_allow_pass():
    main = _script(_edit(_fixed(*FIX), *(e for edits in RULE_KEEPING.values() for e in edits)), "rules_kept")
    for check in CHECKS.values():
        check(main)
        check(main, **HIDDEN)


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
def test_the_loaded_buggy_script_scores_zero_with_symptoms(tmp_path):
    """What a student who ran `%load buggy_training.py` and changed nothing submits."""
    nb = submissions.replace_answer(submissions.load(A, NB), "ex2d_script", "# %load buggy_training.py\n" + BUGGY)
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    assert report.score == 0, submissions.messages(report)
    got = submissions.messages(report)
    assert "the same samples in the same order" in got["ex2d_test_shuffle"]
    assert "mean of the ranks' own accuracies" in got["ex2d_test_metric"]
    assert "does not load into the model without DDP" in got["ex2d_test_checkpoint"]
    assert "deadlocked" in got["ex2d_test_finishes"]
