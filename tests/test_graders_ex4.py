"""Exercise 4's checks: real torchrun launches of right and wrong training scripts.

A launch costs 5-30 s here, so every script is launched at most twice (the two
runs every check shares) and most wrong scripts are graded as notebooks, which
exercises every check at once: each must lose exactly the intended test cells.
The reference is graded once (a module fixture): a test that judges the reference's
runs reads that grade's runs, and the launcher's memo, instead of launching it again.
Unit tests cover what the notebooks do not: hangs, the static stub check, the
probe's view of file writes, and wrong scripts that need one launch only.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import types

import pytest
import submissions
import torch

import graders.common.torchrun_model as ex4_model
import graders.torchrun.checks as ex4
import graders.torchrun.destroy as ex4_destroy
import graders.torchrun.restart as ex4_restart
from course.checks import torchrun
from course.launcher.torchrun import runner
from course.launcher.torchrun.workers import ZYGOTE_NAME

A = "ex4-torchrun"
SCRIPT_CELL = "ex4_train_script"
LAUNCH_TIMEOUT = 600  # two torchrun launches on a loaded 2-core machine, with room to spare
#: the 2-node run's deadline in the hang test (test-only: the grader's is runner.NODES_TIMEOUT, 180 s). The job
#: reaches its hang at the end of main, after training: a whole 2-node run of the reference took 15 s on this 2-core
#: machine at load 100, and the rest of the deadline is spent idle, so it is twice that (it was 45 s)
HANG_TIMEOUT = 30.0
#: the seconds with no worker left after which the stranded 2-node run is stopped, in the test that strands one
#: (test-only: the grader's is runner.STRANDED_AFTER, 15 s, spent idle; the run has no worker again once stranded).
#: Measured at load 40-70: stranded in 3 launches of 3 at 5 s (15-20 s in all); at 15 s, 1 of 3 (22 s), the
#: others' agents ending first, a race the test's `run.stranded` could lose
STRANDED_AFTER = 5.0
#: the hidden tests' restart run, as the notebook's hidden cells ask for it (a test keeps the two in step)
HIDDEN = {"crash_rank": 0, "crash_step": 3, "layout": (1, 1)}


def script_source(nb=None) -> str:
    """train.py as the notebook's %%writefile cell writes it (solution included)."""
    text = submissions.answer(nb or submissions.load(A), SCRIPT_CELL)
    first, rest = text.split("\n", 1)
    assert first.strip() == "%%writefile train.py", first
    return "\n".join(line for line in rest.splitlines() if "### BEGIN SOLUTION" not in line
                     and "### END SOLUTION" not in line) + "\n"


ENTRY = "\n\n# ---- given: the entry point (do not change it) ----\n"


def given_parts() -> tuple[str, str]:
    """The given code before the student's part (up to ``# ---- yours ----``) and the given entry point after it."""
    source = script_source()
    return source[:source.index("# ---- yours ----\n") + len("# ---- yours ----\n")], source[source.index(ENTRY):]


def write_script(tmp_path, *edits: tuple[str, str]) -> str:
    """The reference train.py with ``(old, new)`` edits (each ``old`` must occur once), written to tmp_path."""
    source = script_source()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path = tmp_path / "train.py"
    path.write_text(source)
    return str(path)


fails = submissions.fails


# --- fast: no launch ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_test_cell_has_a_hidden_variant_on_the_hidden_restart_run():
    """The hidden part of each test cell calls its check once more on the run HIDDEN names (the tests here play
    that run), but the standalone rank test's: on two nodes it would judge the multi-node ranks a second time
    (a RANK/LOCAL_RANK mix-up would lose both cells)."""
    nb = submissions.load(A)
    cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(cells) == 7
    assert cells[0].source == 'graders.torchrun.check_standalone_ranks("train.py")'
    for cell in cells[1:]:
        hidden = cell.source.split("### BEGIN HIDDEN TESTS", 1)[1].split("### END HIDDEN TESTS")[0]
        calls = re.findall(r"graders\.torchrun\.(check_\w+)\(\"train\.py\", (.*)\)", hidden)
        assert len(calls) == 1 and calls[0][1] == "crash_rank=0, crash_step=3, layout=(1, 1)", cell.source
        assert HIDDEN == {"crash_rank": 0, "crash_step": 3, "layout": (1, 1)}


@pytest.mark.timeout(60)
def test_a_workers_attempt_is_its_rendezvous_round_not_its_restart_count():
    """Workers as (pid, rank, (WORLD_SIZE, MASTER_ADDR, MASTER_PORT), start time): a round is one key; rounds
    follow their start; an agent that restarted for a waiting node keeps TORCHELASTIC_RESTART_COUNT=0, which
    the key does not read; a port drawn again in a later round still opens a new round."""
    a, b = ("2", "127.0.0.1", "4001"), ("2", "127.0.0.1", "4002")
    starts = [(10, 0, a, 1.0), (11, 1, a, 1.1), (12, 0, b, 5.0), (13, 1, b, 5.2), (14, 0, a, 9.0), (15, 1, a, 9.1)]
    assert runner.rounds(starts) == {10: 0, 11: 0, 12: 1, 13: 1, 14: 2, 15: 2}
    assert runner.rounds(list(reversed(starts))) == {10: 0, 11: 0, 12: 1, 13: 1, 14: 2, 15: 2}
    assert runner.rounds([]) == {}


@pytest.mark.timeout(60)
def test_the_graders_copy_of_the_given_code_matches_the_notebook():
    """expected_weights() trains the grader's copy of make_model/get_batch/SGD: it must be the script's."""
    source = script_source()
    given = source[:source.index("# ---- yours ----")]
    namespace: dict = {}
    exec(compile(given, "train.py", "exec"), namespace)
    for name in ("EPOCHS", "STEPS_PER_EPOCH", "LR", "MOMENTUM"):
        assert namespace[name] == getattr(ex4, name), name
    mine, theirs = ex4.make_model().state_dict(), namespace["make_model"]().state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    for args in ((0, 0, 0), (2, 3, 1)):
        assert all(torch.equal(a, b) for a, b in zip(ex4.get_batch(*args), namespace["get_batch"](*args)))
    optimizer = namespace["make_optimizer"](namespace["make_model"]())
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == ex4.LR and optimizer.defaults["momentum"] == ex4.MOMENTUM


@pytest.mark.timeout(60)
def test_expected_weights_are_sgd_with_momentum_on_the_global_batch():
    """The hand-written update in expected_weights equals torch.optim.SGD on all ranks' batches."""
    model = ex4.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex4.LR, momentum=ex4.MOMENTUM)
    for epoch in range(ex4.EPOCHS):
        for step in range(ex4.STEPS_PER_EPOCH):
            batches = [ex4.get_batch(rank, epoch, step) for rank in range(3)]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    expected = ex4.expected_weights(3)
    assert max(float((model.state_dict()[k] - expected[k]).abs().max()) for k in expected) < 1e-6
    # and rank 0 alone trains something else, so "no gradient averaging" shows
    assert ex4.compare_weights(ex4.expected_weights(3, (0,)), expected) > 1e-3


@pytest.mark.timeout(60)
def test_expected_weights_after_a_restart_follow_the_resume():
    """The hidden DDP variant's references: an exact resume is the uninterrupted run; an off-by-one resume or
    lost momentum is not (so a wrong resume is judged by check_restart_resume alone, not taken for DDP's)."""
    exact = ex4.expected_weights(2, None, (1, 1, True))
    assert ex4.compare_weights(exact, ex4.expected_weights(2)) == 0
    assert ex4.compare_weights(ex4.expected_weights(2, None, (0, 0, True)), ex4.expected_weights(2)) == 0  # never loaded
    for wrong in ((1, 0, True), (1, 1, False), (1, 2, True)):
        assert ex4.compare_weights(ex4.expected_weights(2, None, wrong), exact) > 1e-4, wrong
    assert ex4.compare_weights(ex4.expected_weights(2, (0,), (1, 1, True)), ex4.expected_weights(2, (0,))) == 0
    # the grader's shift of the checkpoint is carried by a run that loaded it, and only by one that did
    shifted = ex4.expected_weights(2, None, (1, 1, True, 1234))
    assert ex4.compare_weights(shifted, exact) > 1e-3
    assert ex4.compare_weights(ex4.expected_weights(2, None, (1, 1, True, None)), exact) == 0
    assert ex4.compare_weights(ex4.expected_weights(2, None, (0, 0, True, 1234)), ex4.expected_weights(2)) == 0


@pytest.mark.timeout(60)
def test_a_workers_own_batches_carry_its_secret_offset_and_no_other_batch_does(monkeypatch):
    """The prelude of the grader's runs (install, in each worker before the script): in the worker of rank 1 the
    given get_batch(1, e, s) returns inputs moved by that worker's secret offset (y follows them); the batches
    of the other ranks, and every other draw of torch.randn, are torch's own."""
    monkeypatch.setattr(torch, "randn", torch.randn)  # undone after the test
    public = {(r, e, s): ex4_model.get_batch(r, e, s) for r in range(3) for e in range(ex4.EPOCHS)
              for s in range(ex4.STEPS_PER_EPOCH)}
    wanted = {key: ex4_model.batch_of(*key, 424242 if key[0] == 1 else None) for key in public}  # the grader's
    assert not torch.equal(ex4_model.batch_of(1, 0, 0, 1)[0], ex4_model.batch_of(1, 0, 0, 2)[0])  # secret-bound
    ex4_model.install(1, 424242)
    for (r, e, s), (x, _y) in public.items():
        got_x, got_y = ex4_model.get_batch(r, e, s)
        want_x, want_y = wanted[r, e, s]
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y), (r, e, s)
        assert torch.equal(got_x, x) is (r != 1), (r, e, s)
        if r == 1:
            assert (got_x - x).abs().mean() > 0.1  # an offset the weights feel (OFFSET 0.5 a value)
    g = torch.Generator().manual_seed(1001)
    assert torch.equal(torch.randn(3, generator=g), ex4_model._randn(3, generator=torch.Generator().manual_seed(1001)))


def test_the_workers_secrets_come_from_the_zygotes_reports_per_rank_and_launch():
    forks = [(10, 0, 7), (11, 1, 8), (12, None, 9), (13, 1, 18), (14, 0, 17), (15, 2, None)]
    assert ex4.secrets_of(forks, 3) == ((7, 8, None), (17, 18, None))
    assert ex4.secrets_of([], 2) == ((None, None), (None, None))
    exact = ex4.expected_weights(2, data=((5, 6),))
    assert ex4.compare_weights(exact, ex4.expected_weights(2)) > 1e-3  # the offsets change what is learnt
    assert ex4.compare_weights(ex4.expected_weights(2, data=((None, None),)), ex4.expected_weights(2)) == 0
    # after a restart, the epochs before it are trained on the first launch's batches, those after on the second's
    resumed = ex4.expected_weights(2, None, (1, 1, True), ((5, 6), (7, 8)))
    assert ex4.compare_weights(resumed, ex4.expected_weights(2, None, (1, 1, True), ((5, 6), (5, 6)))) > 1e-4
    assert ex4.compare_weights(resumed, ex4.expected_weights(2, None, (1, 1, True), ((7, 8), (7, 8)))) > 1e-4
    # every worker recomputing the first epochs by itself: without offsets the ranks agree, and that is one run
    assert ex4.compare_weights(ex4.replayed_by_hand(2, 2, (None, None)), ex4.expected_weights(2)) <= 1e-6
    assert ex4.compare_weights(ex4.replayed_by_hand(2, 2, (5, 6)), ex4.expected_weights(2, data=((5, 6),))) > 1e-4


def test_unwritten_and_broken_scripts_fail_at_once_without_a_launch(tmp_path):
    stub = tmp_path / "stub.py"
    source = script_source()
    given, entry = given_parts()
    main_at = source.index("def main(args):")
    stub.write_text(source[:main_at] + "def main(args):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n" + entry)
    broken = tmp_path / "broken.py"
    broken.write_text(source.replace("def main(args):", "def main(args)", 1))
    released = tmp_path / "released.py"  # the student's copy: the given part, nbgrader's stub at module level, the entry
    released.write_text(given + "# YOUR CODE HERE\nraise NotImplementedError()\n" + entry)
    start = time.monotonic()
    for check, kwargs in ((ex4.check_standalone_ranks, {}), (ex4_restart.check_restart_resume, {}), (ex4_destroy.check_destroy, {}),
                          (ex4.check_checkpoint_rank0, HIDDEN), (ex4.check_ddp_training, HIDDEN),
                          (ex4.check_multinode_ranks, HIDDEN)):
        fails(check, str(stub), "train.py is not written yet", "raise NotImplementedError()", **kwargs)
        fails(check, str(released), "train.py is not written yet", "raise NotImplementedError()", **kwargs)
        fails(check, str(broken), "does not compile", "line", **kwargs)
        fails(check, str(tmp_path / "missing.py"), "there is no training script", "%%writefile", **kwargs)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_student_traceback_drops_torch_prefixes_and_the_graders_frames():
    output = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/x/graders/torchrun_probe.py", line 160, in <module>\n'
        "[rank1]:     main()\n"
        '[rank1]:   File "<frozen runpy>", line 88, in _run_code\n'
        '[rank1]:   File "/tmp/train.py", line 12, in main\n'
        "[rank1]:     local_rank = args.local_rank\n"
        "[rank1]: AttributeError: 'Namespace' object has no attribute 'local_rank'\n"
    )
    tb = torchrun.student_traceback(output)
    assert "torchrun_probe" not in tb and "runpy" not in tb and "[rank1]" not in tb
    assert '  File "/tmp/train.py", line 12, in main' in tb
    assert tb.splitlines()[-1] == "AttributeError: 'Namespace' object has no attribute 'local_rank'"


# --- one launch each ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_check_ddp_training_catches_gradients_never_averaged(tmp_path):
    script = write_script(tmp_path, ("ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)",
                                     "ddp_model = model"))
    fails(ex4.check_ddp_training, script, "differ from an uninterrupted 3-rank DDP run",
          "the gradients were never averaged")
    ex4_destroy.check_destroy(script)  # the same run: everything else about it is fine


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_right_weights_computed_without_communication_are_not_ddp(tmp_path):
    """A forgery: every rank trains on every rank's batches by itself (get_batch is given and deterministic),
    and all-reduces a decoy of the model's size each step, so torch's flight recorder lists as many all-reduced
    values as DDP's would. Each worker's own batches carry an offset only it and the grader know, so the
    batches of the other ranks computed in rank 0 lack theirs: the weights give it away."""
    script = write_script(
        tmp_path,
        ("ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)", "ddp_model = model"),
        ("        train_epoch(ddp_model, optimizer, rank, epoch, device)\n",
         "        for step in range(STEPS_PER_EPOCH):\n"
         "            batches = [get_batch(r, epoch, step) for r in range(world_size)]\n"
         "            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])\n"
         "            loss = loss_fn(ddp_model(x), y)\n"
         "            optimizer.zero_grad()\n"
         "            loss.backward()\n"
         "            dist.all_reduce(torch.zeros(sum(p.numel() for p in ddp_model.parameters())))  # the decoy\n"
         "            optimizer.step()\n"))
    run = ex4.graded_run(script, "test", None, None)
    first, _ = ex4.secrets_of(run.forks, 3)
    assert None not in first and len(set(first)) == 3  # every worker forked, each with a secret of its own
    assert ex4.compare_weights(run.final, ex4.expected_weights(3, data=((first[0], None, None),))) <= ex4.ATOL
    fails(ex4.check_ddp_training, script, "the other ranks' batches computed in rank 0's own worker",
          "their gradients never came from the other workers", "do not compute the other ranks' batches yourself")
    ex4.check_checkpoint_rank0(script)  # the same run: the rest of it is fine


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_check_destroy_sees_the_default_group_left_not_a_call(tmp_path):
    """Destroying another group (or a patched destroy_process_group) leaves the default group: no point."""
    subgroup = write_script(tmp_path, ("    dist.destroy_process_group()\n",
                                       "    dist.destroy_process_group(dist.new_group(list(range(world_size))))\n"))
    fails(ex4_destroy.check_destroy, subgroup, "ranks 0, 1, 2 still held the default process group at exit")
    (tmp_path / "patched").mkdir()
    patched = write_script(tmp_path / "patched",
                           ("    dist.destroy_process_group()\n",
                            "    dist.destroy_process_group = lambda *a, **k: None\n    dist.destroy_process_group()\n"))
    fails(ex4_destroy.check_destroy, patched, "ranks 0, 1, 2 never called destroy_process_group")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_try_restart_prints_what_each_rank_did_in_each_attempt(tmp_path, capsys):
    script = write_script(tmp_path, ('first_epoch = saved["epoch"] + 1', 'first_epoch = saved["epoch"]'))
    run = ex4_restart.try_restart(script, **HIDDEN)
    out = capsys.readouterr().out
    assert run.crash == (0, 3) and run.layout == (1, 1) and run.world_size == 2
    assert "the 2-node restart run (two torchrun agents, --nnodes=2" in out, out
    # both rounds on both nodes: the second node's worker is rank 1 with LOCAL_RANK 0, restarted too
    assert [(w.attempt, w.rank, w.local_rank, w.group_rank) for w in run.workers] == [
        (0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 0, 0), (1, 1, 0, 1)], run.workers
    assert "rank 0 was killed after its optimizer step 3, in epoch 1" in out, out
    assert "attempt 0 (the first launch):\n  rank 0: no checkpoint loaded, 3 optimizer step(s)" in out, out
    assert "killed by the grader" in out and "attempt 1 (torchrun's restart):" in out, out
    # off by one: resumed at the saved epoch 0 again, so 8 steps instead of 6, and the weights are wrong
    assert "rank 1: loaded the checkpoint, 8 optimizer step(s)" in out, out
    assert "final.pt: differs from a run resumed from the checkpoint (the grader shifted its weights) by" in out, out
    fails(ex4_restart.check_restart_resume, script, "rank 0 was killed after its optimizer step 3",
          "trained 8 steps: it started from epoch 0 again", "(6 steps)", "saved epoch + 1", **HIDDEN)
    with pytest.raises(ValueError, match="middle of an epoch"):
        ex4_restart.try_restart(script, crash_step=4)  # an epoch's last step races with its checkpoint
    with pytest.raises(ValueError, match="one of the 2 ranks"):
        ex4_restart.try_restart(script, crash_rank=2, crash_step=3, layout=(1, 1))
    # the resume's mistake only: the hidden variants of the other cells read this same run, and pass
    for check in (ex4.check_standalone_ranks, ex4.check_checkpoint_rank0, ex4.check_atomic_checkpoint,
                  ex4.check_ddp_training, ex4_destroy.check_destroy, ex4.check_multinode_ranks):
        check(script, **HIDDEN)
    assert [key[2:] for key in runner._CACHE if key[0] == script] == [("restart", (0, 3), (1, 1), ex4.PRELUDE)]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_check_atomic_checkpoint_wants_the_temporary_file_next_to_the_checkpoint(tmp_path):
    script = write_script(tmp_path, ('tmp_path = ckpt_path + ".tmp"',
                                     'tmp_path = "/tmp/ddp-course-test-%d.tmp" % os.getpid()'))
    fails(ex4.check_atomic_checkpoint, script, "not in the checkpoint's folder", "one file system")
    ex4.check_checkpoint_rank0(script)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_check_restart_resume_catches_an_off_by_one_resume(tmp_path):
    script = write_script(tmp_path, ('first_epoch = saved["epoch"] + 1', 'first_epoch = saved["epoch"]'))
    fails(ex4_restart.check_restart_resume, script, "final weights differ from a 2-rank run resumed from the checkpoint",
          "trained 6 steps, not 4", "off by one")
    ex4.check_standalone_ranks(script)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_check_restart_resume_catches_a_forgotten_optimizer_state(tmp_path):
    script = write_script(tmp_path, ('        optimizer.load_state_dict(saved["optimizer"])\n', ""))
    fails(ex4_restart.check_restart_resume, script, "final weights differ", "restore the optimizer state too")
    # the hidden crash: the lost momentum is the resume's mistake, not the gradient averaging's
    fails(ex4_restart.check_restart_resume, script, "rank 0 was killed after its optimizer step 3", "final weights differ",
          **HIDDEN)
    ex4.check_ddp_training(script, **HIDDEN)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_hidden_variants_judge_the_hidden_restart_run_without_a_launch_of_their_own(tmp_path):
    """The hidden tests of the checkpoint, atomicity, ranks and destroy cells read the restart run on two nodes
    with rank 0 killed after its step 3 (the launch the hidden check_restart_resume makes): one script with four
    mistakes, each caught there, and one launch for them all. (The DDP cell's hidden test: the next test.)"""
    script = write_script(
        tmp_path,
        ('    tmp_path = ckpt_path + ".tmp"  # same folder, so os.replace stays on one file system\n'
         "    torch.save(state, tmp_path)\n"
         "    os.replace(tmp_path, ckpt_path)  # atomic: a reader sees the old checkpoint or the new one, never half\n",
         "    torch.save(state, ckpt_path)\n"),
        ("            save_checkpoint(state, args.ckpt)\n",
         "            save_checkpoint(state, args.ckpt)\n"
         "        else:  # a copy of its own, beside the folders it was given\n"
         "            import pickle\n"
         "            with open(os.path.join(os.path.dirname(args.out), f'copy-rank{rank}.pkl'), 'wb') as fh:\n"
         "                pickle.dump(model.state_dict(), fh)\n"),
        ("    dist.destroy_process_group()\n", ""),
        ('"world_size": world_size}', '"world_size": 3}'))  # the size of the visible 2-node run, hard-coded
    fails(ex4.check_checkpoint_rank0, script, "rank 0 was killed after its optimizer step 3",
          "rank 1 wrote the checkpoint too", "copy-rank1.pkl", **HIDDEN)
    fails(ex4.check_atomic_checkpoint, script, "wrote the checkpoint in place", **HIDDEN)
    fails(ex4_destroy.check_destroy, script, "rank 0 was killed after its optimizer step 3",
          "ranks 0, 1 never called destroy_process_group", **HIDDEN)
    fails(ex4.check_multinode_ranks, script, "world_size=3, but torchrun set WORLD_SIZE=2", "never hard-code it",
          **HIDDEN)
    ex4.check_ddp_training(script, **HIDDEN)  # the weights are right
    launched = [key for key in runner._CACHE if key[0] == script]
    assert launched == [(script, launched[0][1], "restart", (0, 3), (1, 1), ex4.PRELUDE)], launched


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_hidden_ddp_variant_catches_gradients_never_averaged_after_the_crash(tmp_path, monkeypatch):
    """Without DDP the ranks never wait on each other: on two nodes, rank 1 finishes alone after rank 0 died, its
    agent waits at the exit while rank 0's waits for it to meet again. The grader stops that run after
    STRANDED_AFTER s with no worker (not torch's minutes), and the check names the mistake: no gradient was
    averaged. (On one node, --standalone, the same script ends: the restarted ranks drift apart, and rank 0's
    final weights are what it learns alone; so does this run when rank 1's agent restarts its worker before the
    worker finished, a race of torchrun's agents, seen once in two full runs of the suite after workers started faster.)"""
    monkeypatch.setattr(runner, "STRANDED_AFTER", STRANDED_AFTER)  # the runner reads it: a wait spent idle
    script = write_script(tmp_path, ("ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)",
                                     "ddp_model = model"))
    run = ex4_restart.try_restart(script, **HIDDEN)
    if run.ok:
        # torchrun's race: rank 1's agent saw rank 0's agent ask for a new round before its own worker had
        # finished, and restarted it too; the job ended, and its weights name the mistake
        fails(ex4.check_ddp_training, script, "rank 0's final weights differ from a 2-rank DDP run",
              "the gradients were never averaged", "Wrap the model in DDP", **HIDDEN)
        return
    fails(ex4.check_ddp_training, script, "ranks 0, 1 did not average gradients with the other ranks",
          "all-reduced 0 values in 3 optimizer steps", "wrap the model in DDP", **HIDDEN)
    assert run.stranded and run.elapsed < runner.STRANDED_AFTER + 30, run.elapsed
    fails(ex4_restart.check_restart_resume, script, "the 2-node restart run", "never ended",
          "the torchrun agents went on waiting for each other", "did not wait on it", **HIDDEN)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_hung_job_is_killed_at_the_deadline_naming_the_stuck_ranks(tmp_path, monkeypatch):
    """Ranks 1 and 2 wait for a file nobody writes (world size 3 only): the 2-node run hangs."""
    monkeypatch.setattr(runner, "NODES_TIMEOUT", HANG_TIMEOUT)  # the runner reads it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the job's folder (its workers' cwd) in tmp_path
    script = write_script(tmp_path, ("    dist.destroy_process_group()\n",
                                     "    while rank != 0 and world_size == 3:\n"
                                     "        time.sleep(0.1)  # waits for a file nobody writes\n"
                                     "    dist.destroy_process_group()\n"),
                          ("import json\n", "import json\nimport time\n"))
    start = time.monotonic()
    message = fails(ex4_destroy.check_destroy, script, f"did not finish within {HANG_TIMEOUT:g} s", "(stuck)")
    # ranks 1 and 2 are named (rank 0 too if a loaded machine had not let it finish yet)
    assert re.search(r"\[ranks (0, )?1, 2\]", message), message
    assert re.search(r'File ".*train\.py", line \d+ in main', message), message  # where each one was stuck
    assert time.monotonic() - start < HANG_TIMEOUT + 40
    ex4.check_multinode_ranks(script)  # the reports came before the hang
    # this job's workers only: another test (another xdist worker) may be running torchrun jobs meanwhile
    leftovers = [p for p in _processes() if "torchrun_probe" in p and str(tmp_path) in p]
    assert not leftovers, leftovers


def _processes() -> list[str]:
    """Every process as its name, command line and working folder (a worker forked by its agent's zygote has the
    zygote's command line, its own name and the job's folder: the tests that look put the job folder in tmp_path)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline", "cwd"]):
        try:
            found.append(f"{proc.info['name']} {' '.join(proc.info['cmdline'] or [])} cwd={proc.info['cwd']}")
        except psutil.Error:
            pass
    return found


#: a process that launches a job under torchrun, as a check does, and waits for it
_LAUNCHER = "import sys\nfrom course.launcher import torchrun\ntorchrun.run_script(sys.argv[1], 'nodes', layout=(1, 2))\n"


def _cmdline(proc) -> str:
    import psutil

    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _is_worker(proc) -> bool:
    """A torchrun worker: forked by its agent's zygote (named after the probe it runs) or exec'd on the probe."""
    import psutil

    try:
        # exec'd: `python -u .../torchrun_probe.py SCRIPT ...` (an agent's, or its zygote's, command line names the
        # probe further on: its own arguments)
        return proc.name() == "torchrun_probe" or proc.cmdline()[1:3] == ["-u", runner.PROBE_SCRIPT]
    except psutil.Error:
        return False


def _still_running(procs: list, within: float) -> list:
    """Those of ``procs`` still running after ``within`` s (a zombie waiting for its reaper counts as ended)."""
    import psutil

    end = time.monotonic() + within
    while True:
        running = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
            except psutil.Error:
                pass
        if not running or time.monotonic() > end:
            return running
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_no_agent_or_worker_outlives_the_process_that_launched_them(tmp_path, sig):
    """The agents and their workers run in sessions of their own (the launcher stops each job's whole tree), so
    a launching process killed before it could stop them (SIGTERM does not run its cleanup, SIGKILL nothing) left
    them running: the agents die with it, and the workers with them."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(600)  # until stopped\n")
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(script)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(tmp_path)})  # its job folder
    tree: list = []
    try:
        launcher, end = psutil.Process(proc.pid), time.monotonic() + 150
        while len([p for p in tree if _is_worker(p)]) < sum(ex4.NODES_WORKERS):
            assert proc.poll() is None, "the launching process ended before its workers ran"
            assert time.monotonic() < end, [_cmdline(p) for p in tree]
            time.sleep(0.2)
            tree = launcher.children(recursive=True)
        # the agents are forked from the launcher's agent zygote (its child, named a zygote), or exec'd by the
        # launcher (their command line names the agent module); each agent's own zygote and workers are below them
        zygotes = {p.pid for p in tree if p.ppid() == proc.pid and p.name() == ZYGOTE_NAME}
        agents = [p for p in tree if p.name() != ZYGOTE_NAME and not _is_worker(p)
                  and (p.ppid() in zygotes or (p.ppid() == proc.pid and "course.launcher.torchrun.agent" in _cmdline(p)))]
        assert len(agents) == 2, [(p.name(), p.ppid(), _cmdline(p)) for p in tree]
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=30)
        left = _still_running(tree, within=15)
        assert not left, [(p.pid, _cmdline(p)) for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in tree:  # nothing of this test's is left for the next one, whatever failed
            try:
                p.kill()
            except psutil.Error:
                pass


def _worker(rank, output="", events=("start", "exit"), pid=None, t=0.0):
    return torchrun.Worker(pid=pid or 100 + rank, rank=rank, local_rank=rank, world_size=3, group_rank=0, attempt=0,
                           events=[{"event": e, "t": t + i} for i, e in enumerate(events)], output=output)


def _run(workers, timed_out=False, alive=(), log=""):
    return torchrun.Run(scenario="nodes", crash=None, layout=(1, 2), command="the run", returncodes=[1], timed_out=timed_out,
                        timeout=9.0, elapsed=1.0, log=log, out_dir="/nonexistent", ckpt_path="/nonexistent/c",
                        workers=list(workers), alive_at_deadline=set(alive))


def _traceback(line: str) -> str:
    return f'Traceback (most recent call last):\n  File "train.py", line 3, in main\n    x()\n{line}\n'


def test_a_failure_leads_with_the_rank_whose_own_code_raised_not_those_that_lost_it():
    lost = _traceback("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    run = _run([_worker(0, lost, t=5), _worker(1, _traceback("ValueError: bad shape"), t=9), _worker(2, lost, t=6)])
    message = str(torchrun.failure("check_x", run))
    assert message.startswith("FAILED check_x [ranks 0, 1, 2]: the run failed: rank 1 (LOCAL_RANK 1, node 0, "
                              "attempt 0) raised ValueError: bad shape; then ranks 0, 2 failed after it "
                              "(lost their peer)"), message


def test_a_worker_that_died_comes_first_with_its_exit_reason_and_its_own_output():
    log = ("Root Cause (first observed failure):\n[0]:\n  rank      : 2 (local_rank: 1)\n"
           "  exitcode  : -6 (pid: 102)\n  traceback : Signal 6 (SIGABRT) received by PID 102\n")
    lost = _traceback("RuntimeError: Connection closed by peer")
    died = _worker(2, "step 3 done\nterminate called without an active exception\n", events=("start", "step"))
    run = _run([_worker(0, lost), _worker(1, events=("start", "step")), died], timed_out=True, alive={101}, log=log)
    message = str(torchrun.failure("check_x", run))
    assert "rank 2 (LOCAL_RANK 2, node 0, attempt 0) died (killed by signal SIGABRT); then rank 0 failed after it " \
           "(lost its peer) and rank 1 was left waiting" in message, message
    assert "terminate called without an active exception" in message  # the dead worker's own last output
    stuck = _run([_worker(0), _worker(1, events=("start", "step"))], timed_out=True, alive={101})
    assert "rank 1 was still running (stuck)" in str(torchrun.failure("check_x", stuck))


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_collective_only_rank0_calls_is_a_deadlock_found_in_seconds(tmp_path, monkeypatch):
    """A barrier inside `if rank == 0:` (after its save): the workers' collectives disagree, so the run
    stops long before its deadline, each worker lined up with its collective and its line of train.py."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the job's folder (its workers' cwd) in tmp_path
    script = write_script(tmp_path, ("            save_checkpoint(state, args.ckpt)\n",
                                     "            save_checkpoint(state, args.ckpt)\n"
                                     "            dist.barrier()  # wait until the file is there\n"))
    start = time.monotonic()
    message = fails(ex4.check_checkpoint_rank0, script, "deadlocked: rank 0 waits in barrier",
                    'train.py", line', "dist.barrier()  # wait until the file is there",
                    "rank 1 waits in all_reduce", "rank 2 waits in all_reduce", "loss.backward()",
                    "inside `if rank == ...:`")
    assert time.monotonic() - start < torchrun.NODES_TIMEOUT / 3, message
    leftovers = [p for p in _processes() if "torchrun_probe" in p and str(tmp_path) in p]
    assert not leftovers, leftovers


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_worker_that_skips_the_last_epoch_is_a_deadlock_found_in_seconds(tmp_path):
    """Rank 2 leaves the loop one epoch early (it returns, its peers wait in DDP's all-reduce)."""
    script = write_script(tmp_path, ("    for epoch in range(first_epoch, EPOCHS):\n",
                                     "    for epoch in range(first_epoch, EPOCHS - (rank == 2)):\n"))
    start = time.monotonic()
    message = fails(ex4.check_ddp_training, script, "rank 2")
    # found as a deadlock (rank 2 returned, the others wait), or, when rank 2's exit closes its connections
    # first, as the others losing their peer: either way rank 2's early finish leads
    assert ("deadlocked: rank 0 waits in all_reduce" in message and "rank 2 had returned from the function" in message) \
        or "rank 2 (LOCAL_RANK 1, node 1, attempt 0) finished while ranks 0, 1 still waited in a collective" in message, \
        message
    assert time.monotonic() - start < torchrun.NODES_TIMEOUT / 3, message


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_worker_killed_by_a_signal_is_named_first_at_once(tmp_path):
    """Rank 2 aborts in epoch 1 (as a crash inside torch would): the message names it and its last words,
    and the others as consequences, without waiting for the deadline."""
    script = write_script(tmp_path, ("        train_epoch(ddp_model, optimizer, rank, epoch, device)\n",
                                     "        train_epoch(ddp_model, optimizer, rank, epoch, device)\n"
                                     "        if rank == 2 and epoch == 1:\n"
                                     "            print('rank 2 about to abort', flush=True)\n"
                                     "            os.abort()\n"))
    start = time.monotonic()
    message = fails(ex4.check_ddp_training, script, "rank 2 (LOCAL_RANK 1, node 1, attempt 0) died (killed by signal "
                    "SIGABRT)", "rank 2 about to abort")
    assert time.monotonic() - start < torchrun.NODES_TIMEOUT / 2, message


# --- the notebook: reference, untouched release, wrong submissions --------------------------------


@pytest.fixture(scope="module")
def reference_graded(tmp_path_factory):
    """The reference notebook graded once (its three launches), with the runs its checks read, keyed as the
    launcher's memo keys them: test_reference_solution_scores_full_marks asserts on the grade, and a test that must
    judge the reference's own runs judges these (each test file runs in one process: no launch of its own)."""
    start = time.monotonic()
    path = submissions.write(submissions.load(A), tmp_path_factory.mktemp("reference"), A)
    report = submissions.grade(path)
    seconds = time.monotonic() - start
    script = str(path.resolve().parent / "train.py")
    runs = {key: run for key, run in runner._CACHE.items() if key[0] == script}
    return types.SimpleNamespace(path=path, report=report, seconds=seconds, script=script, runs=runs)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_reference_solution_scores_full_marks(reference_graded):
    path, report = reference_graded.path, reference_graded.report
    assert submissions.scores(report) == submissions.full_marks(A), submissions.messages(report)
    assert report.max_score == 19
    assert (path.parent / "train.py").exists()  # %%writefile wrote it next to the notebook
    print(f"graded the reference ex4 notebook in {reference_graded.seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_release_scores_zero_at_once_with_clean_messages(tmp_path):
    student = submissions.untouched_student_copy(A, tmp_path)  # checked: no solution, no hidden test
    start = time.monotonic()
    report = submissions.grade(student)
    assert time.monotonic() - start < 60  # no torchrun launch for a script that cannot run
    assert set(submissions.scores(report).values()) == {0.0}
    for gid, message in submissions.messages(report).items():
        assert message.startswith("FAILED check_") and "not written yet" in message, (gid, message)


WRONG = {
    # name: ((old, new) edits of train.py, the test cells that must fail, words the first one's message has)
    "--local_rank read with argparse": (
        [('    return parser.parse_args()\n',
          '    parser.add_argument("--local_rank", type=int, default=0)\n    return parser.parse_args()\n'),
         ('local_rank = int(os.environ["LOCAL_RANK"])', "local_rank = args.local_rank")],
        ["ex4_test_standalone_ranks", "ex4_test_multinode_ranks"], ["no --local_rank argument", "LOCAL_RANK=1"]),
    "RANK used as the local rank (device index)": (
        [('local_rank = int(os.environ["LOCAL_RANK"])', 'local_rank = int(os.environ["RANK"])')],
        ["ex4_test_multinode_ranks"], ["you used RANK as the local rank"]),
    "checkpoint written in place": (
        [('    tmp_path = ckpt_path + ".tmp"  # same folder, so os.replace stays on one file system\n'
          "    torch.save(state, tmp_path)\n"
          "    os.replace(tmp_path, ckpt_path)  # atomic: a reader sees the old checkpoint or the new one, never half\n",
          "    torch.save(state, ckpt_path)\n")],
        ["ex4_test_atomic_checkpoint"], ["wrote the checkpoint in place", "os.replace"]),
    "resume ignored": (
        [("    if os.path.exists(args.ckpt):", "    if False:")],
        ["ex4_test_restart_resume"], ["never read the checkpoint", "started from epoch 0 again"]),
    "checkpoint saved on every rank": (
        [('tmp_path = ckpt_path + ".tmp"', 'tmp_path = ckpt_path + ".tmp%d" % os.getpid()'),
         ("        if rank == 0:  # RANK, not LOCAL_RANK: one writer in the whole job\n", "        if True:\n")],
        ["ex4_test_checkpoint_rank0"], ["ranks 1, 2 wrote the checkpoint too", "if rank == 0:"]),
    "final weights saved on every rank": (
        [('    if rank == 0:\n        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))\n',
          '    torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))\n')],
        ["ex4_test_checkpoint_rank0"], ["ranks 1, 2 wrote the final weights too", "final.pt", "if rank == 0:"]),
    "the other ranks keep a checkpoint of their own elsewhere": (
        [("            save_checkpoint(state, args.ckpt)\n",
          "            save_checkpoint(state, args.ckpt)\n"
          "        else:  # a copy of its own, beside the folders it was given\n"
          "            import pickle\n"
          "            with open(os.path.join(os.path.dirname(args.out), f'copy-rank{rank}.pkl'), 'wb') as fh:\n"
          "                pickle.dump(model.state_dict(), fh)\n")],
        ["ex4_test_checkpoint_rank0"], ["ranks 1, 2 wrote the checkpoint too", "copy-rank1.pkl", "for writing"]),
    "no destroy_process_group": (
        [("    dist.destroy_process_group()\n", "")],
        ["ex4_test_destroy"], ["never called destroy_process_group", "[ranks 0, 1, 2]"]),
}


#: the mistakes graded in one submission: a grade of this notebook launches torchrun three times (a minute on
#: a busy 2-core machine), and mistakes that edit different lines and fail disjoint checks can share it; the
#: submission must lose exactly the union, each check's message naming its own mistake
GRADED_TOGETHER = [  # three mistakes fail check_checkpoint_rank0: three groups, the others shared among them
    ("checkpoint saved on every rank", "no destroy_process_group"),
    ("final weights saved on every rank", "RANK used as the local rank (device index)", "resume ignored"),
    ("the other ranks keep a checkpoint of their own elsewhere", "--local_rank read with argparse",
     "checkpoint written in place"),
]


def test_the_mistakes_graded_together_are_independent():
    submissions.disjoint_mistakes(GRADED_TOGETHER, WRONG)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("group", GRADED_TOGETHER, ids=" + ".join)
def test_wrong_submission_loses_exactly_its_tests(tmp_path, group):
    submissions.grade_mistakes(A, tmp_path, SCRIPT_CELL, WRONG, group)

# ---- appended to tests/test_graders_ex4.py
# --- right answers in other styles: full marks --------------------------------------------------

#: pytorch/examples' ddp-tutorial-series (multigpu_torchrun.py) style: a Trainer class with a snapshot, the global
#: rank from the process group, a NamedTemporaryFile renamed into place, the next epoch stored instead of the last
TUTORIAL_TRAINER = '''
import json
import os
import tempfile

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup():
    dist.init_process_group(backend="gloo")


class Trainer:
    def __init__(self, snapshot_path, out_dir):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = dist.get_rank()
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)
        self.snapshot_path = snapshot_path
        self.out_dir = out_dir
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model)

    def _load_snapshot(self):
        snapshot = torch.load(self.snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epoch + 1}
        folder = os.path.dirname(os.path.abspath(self.snapshot_path))
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
            torch.save(snapshot, f)
        os.replace(f.name, self.snapshot_path)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss_fn(self.model(source), targets).backward()
        self.optimizer.step()

    def train(self):
        for epoch in range(self.epochs_run, EPOCHS):
            for step in range(STEPS_PER_EPOCH):
                self._run_batch(*get_batch(self.global_rank, epoch, step))
            if self.global_rank == 0:
                self._save_snapshot(epoch)
        if self.global_rank == 0:
            torch.save(self.model.module.state_dict(), os.path.join(self.out_dir, "final.pt"))


def main(args):
    ddp_setup()
    trainer = Trainer(args.ckpt, args.out)
    with open(os.path.join(args.out, "report-%d.json" % os.getpid()), "w") as f:
        json.dump({"rank": trainer.global_rank, "local_rank": trainer.local_rank,
                   "world_size": dist.get_world_size()}, f)
    trainer.train()
    dist.destroy_process_group()
'''

#: pathlib and a helper object: the state serialised in memory, written next to the checkpoint and moved with
#: Path.replace; the count of finished epochs stored; the report written after joining the group
PATHLIB_CHECKPOINTER = '''
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Checkpointer:
    path: Path

    def load(self, model, optimizer):
        if not self.path.is_file():
            return 0
        blob = torch.load(self.path, map_location=torch.device("cpu"), weights_only=True)
        model.load_state_dict(blob["weights"])
        optimizer.load_state_dict(blob["optim"])
        return blob["epochs_done"]

    def save(self, model, optimizer, epochs_done):
        buffer = io.BytesIO()
        torch.save({"weights": model.state_dict(), "optim": optimizer.state_dict(), "epochs_done": epochs_done},
                   buffer)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_bytes(buffer.getvalue())
        partial.replace(self.path)


def main(args):
    out, ckpt = Path(args.out), Path(args.ckpt)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    (out / f"report-{os.getpid()}.json").write_text(
        json.dumps({"rank": rank, "local_rank": local_rank, "world_size": world_size}))

    net = make_model()
    opt = make_optimizer(net)
    checkpointer = Checkpointer(ckpt)
    done = checkpointer.load(net, opt)
    ddp_net = DistributedDataParallel(net)
    net.train()
    while done < EPOCHS:
        for step in range(STEPS_PER_EPOCH):
            inputs, targets = get_batch(rank, done, step)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp_net(inputs), targets).backward()
            opt.step()
        done += 1
        if rank == 0:
            checkpointer.save(net, opt, done)
    if rank == 0:
        torch.save(net.state_dict(), out / "final.pt")
    dist.barrier()
    dist.destroy_process_group()
'''


def other_style(body: str) -> str:
    """The answer cell: the given part of train.py, ``body`` as the student's part, the given entry point."""
    given, entry = given_parts()
    return "%%writefile train.py\n" + given + body.strip("\n") + "\n" + entry


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("body", [TUTORIAL_TRAINER, PATHLIB_CHECKPOINTER], ids=["tutorial-trainer", "pathlib-checkpointer"])
def test_a_right_script_in_another_style_scores_full_marks(tmp_path, body):
    nb = submissions.replace_answer(submissions.load(A), SCRIPT_CELL, other_style(body))
    report = submissions.grade(submissions.write(nb, tmp_path, A))
    assert submissions.scores(report) == submissions.full_marks(A), submissions.messages(report)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_forged_probe_record_cannot_pass_an_in_place_checkpoint(tmp_path):
    """Forgery (issue 37): the script saves the checkpoint straight into place, then rewrites its worker's probe
    record (the events file its environment names) so that it shows a save to a temporary file and an os.replace.
    The atomicity check reads the kernel's account of the checkpoint's folder, taken by the grader: it fails."""
    forge = (
        "    torch.save(state, ckpt_path)  # in place\n"
        "    import glob, json\n"
        "    for log in glob.glob(os.path.join(os.environ['DDP_COURSE_PROBE_DIR'], '*')):\n"
        "        try:\n"
        "            lines = [json.loads(x) for x in open(log)]\n"
        "        except (OSError, ValueError):\n"
        "            continue\n"
        "        kept = [e for e in lines if not (e.get('path') == ckpt_path\n"
        "                                       and (e.get('event') == 'save' or e.get('write')))]\n"
        "        kept.append({'event': 'rename', 't': 0, 'src': ckpt_path + '.tmp', 'dst': ckpt_path, 'sha': None})\n"
        "        with open(log, 'w') as fh:\n"
        "            fh.write(''.join(json.dumps(e) + '\\n' for e in kept))\n"
    )
    script = write_script(
        tmp_path,
        ('    tmp_path = ckpt_path + ".tmp"  # same folder, so os.replace stays on one file system\n'
         "    torch.save(state, tmp_path)\n"
         "    os.replace(tmp_path, ckpt_path)  # atomic: a reader sees the old checkpoint or the new one, never half\n",
         forge))
    run = ex4_restart.try_restart(script)
    assert run.files is not None, run.files_problem  # Linux: the kernel's account is there
    assert any(e["event"] == "rename" and e.get("dst") == run.ckpt_path for w in run.workers for e in w.events)
    from graders.torchrun.probe import atomic_from_the_probe

    atomic_from_the_probe("check_atomic_checkpoint", run, "ckpt.pt", "")  # the forged record alone would pass
    fails(ex4.check_atomic_checkpoint, script, "wrote the checkpoint in place", "'ckpt.pt' itself was",
          crash_rank=ex4.CRASH_RANK, crash_step=ex4.CRASH_STEP, layout=ex4.RESTART_WORKERS)
    ex4_restart.check_restart_resume(script)  # the training itself is right


#: Forgery (issue 37): after the restart the script reads only the epoch from the checkpoint (so the probe sees a
#: load) and recomputes the epochs before it by hand, every rank's batches in one process with SGD's momentum
#: written out (no optimizer step the probe would count); the weights equal an honest resume's, had the checkpoint
#: held what the job wrote. The grader shifts the checkpoint's weights while the job is down: only a resume carries it.
REPLAYED = (
    '        model.load_state_dict(saved["model"])\n'
    '        optimizer.load_state_dict(saved["optimizer"])\n',
    '        fresh = make_model().to(device)\n'
    '        params, momentum = list(fresh.parameters()), [None] * 4\n'
    '        for e in range(saved["epoch"] + 1):\n'
    '            for s in range(STEPS_PER_EPOCH):\n'
    '                batches = [get_batch(r, e, s) for r in range(world_size)]\n'
    '                x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])\n'
    '                grads = torch.autograd.grad(loss_fn(fresh(x), y), params)\n'
    '                with torch.no_grad():\n'
    '                    for i, (p, g) in enumerate(zip(params, grads)):\n'
    '                        momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul_(MOMENTUM).add_(g)\n'
    '                        p.sub_(LR * momentum[i])\n'
    '        model.load_state_dict(fresh.state_dict())\n'
    '        for p, buf in zip(model.parameters(), momentum):\n'
    '            optimizer.state[p]["momentum_buffer"] = buf.clone()\n',
)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_training_replayed_by_hand_instead_of_resumed_loses_the_resume(tmp_path):
    script = write_script(tmp_path, REPLAYED)
    run = ex4_restart.try_restart(script)
    assert run.crash_note is not None  # the grader shifted the checkpoint's weights while the job was down
    restarted = [w for w in run.attempt(1) if w.rank == 0][0]
    assert any(e.get("path") == run.ckpt_path for e in restarted.of("load"))  # the probe saw a load
    assert len(restarted.of("step")) == 4  # and the right number of optimizer steps
    # the weights of a resume that ignored the checkpoint's (shifted) weights: epochs 0-1 recomputed in each
    # worker, the other rank's batches as get_batch gives them there (without that worker's secret offset)
    _, last = ex4.secrets_of(run.forks, 2)
    assert ex4.compare_weights(run.final, ex4.replayed_by_hand(2, 2, last)) <= ex4.ATOL
    fails(ex4_restart.check_restart_resume, script, "never resumed from the checkpoint", "recomputed the epochs",
          "never recompute the epochs before it")
    # the recomputed epochs are no DDP training either (rank 1's batches computed in rank 0)
    fails(ex4.check_ddp_training, script, "differ from a 2-rank DDP run that resumed as this one did",
          crash_rank=ex4.CRASH_RANK, crash_step=ex4.CRASH_STEP, layout=ex4.RESTART_WORKERS)


def test_the_grader_shifts_every_copy_of_the_weights_in_a_checkpoint_and_nothing_else(tmp_path):
    model = ex4.make_model()
    state = {"model": model.state_dict(), "ddp": {f"module.{k}": v for k, v in model.state_dict().items()},
             "optimizer": {"state": {0: {"momentum_buffer": torch.ones(8, 4)}}}, "epoch": 1}
    path = str(tmp_path / "ckpt.pt")
    torch.save(state, path)
    seed = ex4_model.shift_checkpoint(path)
    shifted = torch.load(path, weights_only=True)
    shift = ex4_model.shift_of(seed)
    for name, value in model.state_dict().items():
        assert torch.allclose(shifted["model"][name], value + shift[name])
        assert torch.allclose(shifted["ddp"][f"module.{name}"], value + shift[name])
    assert torch.equal(shifted["optimizer"]["state"][0]["momentum_buffer"], torch.ones(8, 4)) and shifted["epoch"] == 1
    assert max(float(d.abs().max()) for d in shift.values()) > 100 * ex4.ATOL
    assert min(float(d.abs().min()) for d in shift.values()) >= ex4_model.SHIFT * (1 - 1e-6)  # none too small to see
    torch.save({"weights": list(model.parameters())}, path)  # no named weights: left alone, judged unshifted
    assert ex4_model.shift_checkpoint(path) is None
    assert ex4_model.shift_checkpoint(str(tmp_path / "missing.pt")) is None


# --- forgeries: what a student who read graders/ might try ------------------------------------------------------

#: every rank saves the checkpoint (each its own temporary file) and the final weights, and a rank other than 0 then
#: rewrites its probe's event file (through the probe's own descriptor, found from the patched torch.save) without
#: its saves, renames and writes: the probe's record shows rank 0 alone
TIDY_PROBE = '''
def _tidy_probe():
    """Rewrite this worker's probe record without its saves (what a forger would do)."""
    probe = getattr(torch.save, "__globals__", {})
    fd, folder = probe.get("_log_fd"), os.environ.get("DDP_COURSE_PROBE_DIR")
    if fd is None or not folder or int(os.environ["RANK"]) == 0:
        return
    with open(os.path.join(folder, f"events-{os.getpid()}.jsonl")) as fh:
        lines = fh.readlines()
    keep = [line for line in lines if not any(f'"event": "{kind}"' in line for kind in ("save", "saved", "rename"))
            and not ('"event": "open"' in line and '"write": true' in line)]
    os.ftruncate(fd, 0)
    os.write(fd, "".join(keep).encode())


def save_checkpoint(state, ckpt_path):
'''
EVERY_RANK_SAVES_PROBE_TIDIED = [
    ("\ndef save_checkpoint(state, ckpt_path):\n", TIDY_PROBE),
    ('tmp_path = ckpt_path + ".tmp"', 'tmp_path = ckpt_path + ".tmp%d" % os.getpid()'),
    ("    os.replace(tmp_path, ckpt_path)  # atomic: a reader sees the old checkpoint or the new one, never half\n",
     "    os.replace(tmp_path, ckpt_path)  # atomic: a reader sees the old checkpoint or the new one, never half\n"
     "    _tidy_probe()\n"),
    ("        if rank == 0:  # RANK, not LOCAL_RANK: one writer in the whole job\n", "        if True:\n"),
    ('    if rank == 0:\n        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))\n',
     '    torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))\n    _tidy_probe()\n'),
]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_several_writers_with_the_probe_rewritten_fail_check_checkpoint_rank0(tmp_path):
    """Every rank saves; the others rewrite their probe's record to show rank 0 alone. The launcher's own look at the
    workers' open files (at the kernel's inotify events), or its count of moves into place, still sees the other
    writers: the check fails, visible and hidden, and the other cells keep the reference's points (on the two runs
    the check reads: see below)."""
    script = write_script(tmp_path, *EVERY_RANK_SAVES_PROBE_TIDIED)
    # the launcher sees a writer in /proc/<pid>/fd while it holds the file, or else counts the kernel's moves into
    # place: which of the two names it, and whether it caught a writer of the checkpoint or of the final weights
    # first, depends on timing; every rank wrote both
    for message in (fails(ex4.check_checkpoint_rank0, script, "if rank == 0:"),
                    fails(ex4.check_checkpoint_rank0, script, **HIDDEN)):
        assert re.search(r"wrote (the checkpoint|the final weights) too", message), message
        assert "[ranks 1, 2]" in message or "[rank " in message, message
    # the other cells keep their points on these two runs: the visible checks that read the 2-node run, and every
    # hidden variant (the hidden restart run). Not launched for this forgery: the standalone restart run the visible
    # standalone-ranks and restart cells read. That they keep their points when every rank saves the checkpoint and
    # the final weights, the notebook grades of WRONG prove ("checkpoint saved on every rank", "final weights saved
    # on every rank": exactly their cells lost); the probe's tidying cannot reach those two checks, which read the
    # reports, the loads and the optimizer steps, and it removes only the saves, renames and opens for writing
    for check in (ex4.check_multinode_ranks, ex4.check_atomic_checkpoint, ex4.check_ddp_training, ex4_destroy.check_destroy):
        check(script)
    for check in (ex4.check_standalone_ranks, ex4.check_multinode_ranks, ex4.check_atomic_checkpoint,
                  ex4.check_ddp_training, ex4_restart.check_restart_resume, ex4_destroy.check_destroy):
        check(script, **HIDDEN)


#: rank 0 writes the checkpoint once, after the last epoch, and appends to its own probe record a move into place for
#: every epoch it skipped: the record claims a checkpoint per epoch
PADDED_PROBE = [
    ("        if rank == 0:  # RANK, not LOCAL_RANK: one writer in the whole job\n",
     "        if rank == 0 and epoch == EPOCHS - 1:\n"
     "            fd = os.open(os.path.join(os.environ['DDP_COURSE_PROBE_DIR'], f'events-{os.getpid()}.jsonl'),\n"
     "                         os.O_WRONLY | os.O_APPEND)\n"
     "            for _ in range(EPOCHS - 1):\n"
     "                os.write(fd, (json.dumps({'event': 'rename', 'src': args.ckpt + '.tmp', 'dst': "
     "os.path.abspath(args.ckpt)}) + '\\n').encode())\n"
     "            os.close(fd)\n"),
]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_one_checkpoint_with_the_probe_padded_to_one_per_epoch_fails_check_checkpoint_rank0(tmp_path):
    """Rank 0 saves once and pads its probe's record with a move into place per skipped epoch: the kernel's count of
    the checkpoint's moves into place (the launcher watched its folder) is the evidence, and it shows one."""
    script = write_script(tmp_path, *PADDED_PROBE)
    fails(ex4.check_checkpoint_rank0, script, "the checkpoint was put in place 1 time(s)", "kernel's count")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_kernels_count_of_commits_alone_catches_the_rewritten_probe(tmp_path, monkeypatch, reference_graded):
    """With the launcher's look at the workers' open files switched off (a write can be over before it looks), the
    kernel's count of the checkpoint's moves into place, more than one writer makes, still fails the forgery;
    the reference passes, the grader's own move of the checkpoint at the crash not counted against it."""
    from course.launcher import fswatch
    from graders.torchrun import probe as ex4_probe

    monkeypatch.setattr(fswatch.FolderWatch, "_look", lambda self: None)
    edits = [*EVERY_RANK_SAVES_PROBE_TIDIED, ("import json\n", "import json  # count only\n")]
    script = write_script(tmp_path, *edits)
    fails(ex4.check_checkpoint_rank0, script, "'ckpt.pt' was put in place 12 times", "at most 4")
    # the reference: its hidden restart run, launched by the reference notebook's grading (no launch here). The look
    # saw no writer but rank 0 there, so the verdict came from the kernel's count alone, as with the look off: the
    # count, called by itself, passes with the grader's own move of the checkpoint taken off, and so does the check
    hidden = [key for key in reference_graded.runs if key[2:] == ("restart", (0, 3), (1, 1), ex4.PRELUDE)]
    assert len(hidden) == 1, list(reference_graded.runs)
    run = reference_graded.runs[hidden[0]]
    assert run.files is not None and run.crash_note is not None  # the kernel watched; the grader moved CKPT
    ckpt_folder, out = os.path.realpath(os.path.dirname(run.ckpt_path)), os.path.realpath(run.out_dir)
    looked = [(w["rank"], name) for w in run.file_writers.values() if w["rank"] != 0 for folder, name in w["names"]
              if folder == ckpt_folder or (folder == out and not re.fullmatch(r"report-\d+\.json", name))]
    assert looked == [] and not run.files_hidden  # the look: no writer of CKPT or final.pt but rank 0 (reports aside)
    ex4_probe._commits_beyond_one_writer("check_checkpoint_rank0", run, "")
    runner._CACHE.update(reference_graded.runs)  # the launcher's memo: the check judges that same run
    ex4.check_checkpoint_rank0(reference_graded.script, **HIDDEN)
    assert runner._CACHE[hidden[0]] is run


# --- found by a hunt with unusual scripts (2026-12-07) ------------------------------------------------------------

#: right: rank 0 alone reads the checkpoint and broadcasts it; every rank restores it with torch's
#: distributed-checkpoint helpers (set_state_dict makes the optimizer's state with one step at learning rate 0)
READ_ONCE_AND_BROADCAST = '''
import json
import os

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def main(args):
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(args.out, f"report-{os.getpid()}.json"), "w") as fh:
        json.dump({"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world_size": world_size}, fh)
    device = torch.device("cpu")
    model, optimizer = make_model_and_optimizer(device)
    ddp_model = DDP(model)
    holder = [torch.load(args.ckpt, map_location="cpu") if rank == 0 and os.path.exists(args.ckpt) else None]
    dist.broadcast_object_list(holder, src=0)  # one reader, not world_size of them
    start = 0
    if holder[0] is not None:
        set_state_dict(ddp_model, optimizer, model_state_dict=holder[0]["model"],
                       optim_state_dict=holder[0]["optim"])
        start = holder[0]["next_epoch"]
    try:
        for epoch in range(start, EPOCHS):
            train_epoch(ddp_model, optimizer, rank, epoch, device)
            model_sd, optim_sd = get_state_dict(ddp_model, optimizer)  # the model's own keys
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model_sd, "optim": optim_sd, "next_epoch": epoch + 1}, tmp)
                os.replace(tmp, args.ckpt)
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    finally:
        dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_checkpoint_read_by_rank_0_and_broadcast_resumes_right(tmp_path):
    """Only rank 0 reads the checkpoint (the others get it by broadcast), and set_state_dict's step at learning rate
    0 is no training step: both once failed right scripts (the restart check wanted every rank to read the file,
    the gradient-averaging check counted the zero step as one without an all-reduce)."""
    given, entry = given_parts()
    path = tmp_path / "train.py"
    path.write_text(given + READ_ONCE_AND_BROADCAST.strip("\n") + "\n" + entry)
    restart = {"crash_rank": ex4.CRASH_RANK, "crash_step": ex4.CRASH_STEP, "layout": ex4.RESTART_WORKERS}
    ex4_restart.check_restart_resume(str(path))
    ex4.check_ddp_training(str(path), **restart)  # the same launch, judged for the averaging


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_wrappers_state_dict_and_a_checkpoint_saved_once_more_are_named(tmp_path):
    """final.pt saved from the DDP wrapper ('module.' keys: the given model cannot load it) once passed, its prefix
    taken off by the launcher; a checkpoint saved once more after the loop was blamed on the other ranks."""
    script = write_script(
        tmp_path,
        ('    if rank == 0:\n        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))\n',
         '    if rank == 0:\n        save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
         '"epoch": EPOCHS - 1}, args.ckpt)\n'
         '        torch.save(ddp_model.state_dict(), os.path.join(args.out, "final.pt"))\n'))
    fails(ex4.check_ddp_training, script, "[rank 0]", "final.pt holds the DDP wrapper's state dict",
          "'module.' prefix", "ddp_model.module.state_dict()")
    fails(ex4.check_checkpoint_rank0, script, "[rank 0]", "rank 0 put the checkpoint ('ckpt.pt') in place",
          "rank 0's record lists", "not again after the loop")
