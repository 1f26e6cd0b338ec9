"""Every attack, on each grading path where its outcome can differ: the honest part's points and no more,
a clear message, nothing outside the sandbox touched, no process left, within a stated time.

Each path grades its submissions once per session (see conftest.py): ``grade`` ~3 at a
time in this process, ``autograde`` in one ``ddp-course autograde --jobs 3`` run. Which attacks
each path plays, and why, is the table above ``attacks.ATTACKS`` (:func:`attacks.played`): the tests
below are parametrized over the (path, attack) pairs played, never over one that is not.
"""

from __future__ import annotations

import dataclasses
import os
import re

import attacks
import pytest
from runs import sandbox_kind

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: both grading paths; the rootless rerun (tests/test_rootless.py) plays its attacks (attacks.Attack.rootless) on
#: `grade` alone: the sandbox that contains them is the same on both paths, and the root run plays both
PATHS = os.environ.get("DDP_COURSE_ADVERSARIAL_PATHS", "grade,autograde").split(",")
#: every (path, attack) graded in this run
PLAYED = [(p, a.name) for p in PATHS for a in attacks.played(p)]


def paths_playing(name: str) -> list[str]:
    """The paths of this run that grade the attack ``name`` (the tests about one attack run on those)."""
    return [p for p, n in PLAYED if n == name]


def test_each_attack_is_played_where_its_outcome_can_differ():
    """The table above attacks.ATTACKS kept to its own rules: no attack is played nowhere; an attack expected to
    end differently on a path is played on both; the control on both and without root; the students whose
    feedback is checked on autograde."""
    from runs import FEEDBACK_STUDENTS

    for attack in attacks.ATTACKS:
        assert attack.paths and set(attack.paths) <= {"grade", "autograde"}, attack.name
        if attack.per_path:
            assert set(attack.paths) == {"grade", "autograde"}, attack.name
    assert set(attacks.BY_NAME["honest"].paths) == {"grade", "autograde"} and attacks.BY_NAME["honest"].rootless
    for name in FEEDBACK_STUDENTS:
        assert "autograde" in attacks.BY_NAME[name].paths, name


@pytest.fixture(params=PATHS)
def batch(request):
    return request.getfixturevalue(f"{request.param}_batch"), request.param


@pytest.mark.parametrize("path,name", PLAYED)
def test_score_is_the_honest_part(request, path, name):
    run = request.getfixturevalue(f"{path}_batch")
    attack = attacks.for_path(attacks.BY_NAME[name], path)
    outcome = run.outcomes[name]
    expected = attacks.expected_scores(attack, run.source, run.submissions[name])
    got = {gid: outcome.scores.get(gid, 0.0) for gid in expected}
    if attack.survivable and got != expected:  # the kernel recovered from the interrupt: the rest is honest too
        expected = attacks.expected_scores(dataclasses.replace(attack, fatal=False), run.source, run.submissions[name])
    assert got == expected, f"{path} {name}: {outcome.brief()}"
    if attack.ungradable:
        assert outcome.error, f"{path} {name}: an ungradable submission must say why"
    else:
        assert not outcome.error, f"{path} {name}: {outcome.error}"
        assert set(outcome.scores) == set(expected)  # every test scored, none twice


@pytest.mark.parametrize("path,name", [(p, n) for p, n in PLAYED if attacks.for_path(attacks.BY_NAME[n], p).message])
def test_message_names_what_happened(request, path, name):
    run = request.getfixturevalue(f"{path}_batch")
    attack = attacks.for_path(attacks.BY_NAME[name], path)
    assert re.search(attack.message, run.outcomes[name].text()), f"{path} {name}: {run.outcomes[name].text()[-3000:]}"


@pytest.mark.parametrize("path,name", PLAYED)
def test_finishes_within_its_bound(request, path, name):
    run = request.getfixturevalue(f"{path}_batch")
    attack = attacks.BY_NAME[name]
    # grade: several submissions share 2 cores, so allow for the ones graded alongside
    bound = attack.bound() * (1.5 if path == "grade" else 1.0)
    assert run.outcomes[name].elapsed < bound, f"{path} {name}: {run.outcomes[name].elapsed:.0f} s > {bound:.0f} s"


def test_no_process_left_behind(batch):
    run, path = batch
    assert run.leftovers == [], f"{path}: sandbox processes still running: {run.leftovers}"


def test_other_submissions_and_sources_untouched(batch):
    run, path = batch
    assert run.victims_after == run.victims_before
    honest = run.outcomes["honest"]
    expected = attacks.expected_scores(attacks.BY_NAME["honest"], run.source, run.submissions["honest"])
    assert honest.scores == expected


def test_whole_run_bound(batch):
    run, path = batch
    # every submission at its own bound would be the worst case; in practice they overlap 3 at a time
    worst = sum(a.bound() for a in attacks.played(path)) / 2
    assert run.elapsed < worst, f"{path}: {run.elapsed:.0f} s"
    if path == "autograde":  # done in part: the renamed and broken notebooks cannot be graded, and it says so
        assert run.extra["returncode"] == 2, run.extra["stdout"][-3000:] + run.extra["stderr"][-3000:]
        assert "submission(s) could not be graded (listed above)" in run.extra["stderr"]


# --- what only an isolated sandbox guarantees (full as root, or rootless in a user namespace) -------

needs_isolation = pytest.mark.skipif(sandbox_kind() == "partial",
                                reason="isolation needs root, or user namespaces without it (partial sandbox here)")


@needs_isolation
@pytest.mark.parametrize("path", paths_playing("read_sources"))
def test_sources_and_course_files_are_invisible(request, path):
    run = request.getfixturevalue(f"{path}_batch")
    text = run.outcomes["read_sources"].outputs
    assert f"{attacks.READ_MARK} secrets read: 0" in text, text[-3000:]
    for line in attacks.hidden_lines(run.source):
        assert line not in text


@needs_isolation
@pytest.mark.parametrize("path", paths_playing("write_gradebook"))
def test_nothing_written_outside_the_sandbox(request, path):
    run = request.getfixturevalue(f"{path}_batch")
    text = run.outcomes["write_gradebook"].outputs
    assert f"{attacks.WRITE_MARK} wrote" not in text and f"{attacks.WRITE_MARK} planted" not in text, text[-3000:]
    assert run.victims_after == run.victims_before


@needs_isolation
@pytest.mark.parametrize("path", paths_playing("network"))
def test_no_network_beyond_the_sandbox_loopback(request, path):
    """The namespace has no interface but its loopback and no route, and none of this host's own
    addresses (its loopback, outside the namespace; each address of its interfaces) is reached: a
    listener on each, which this process reached before grading, took no connection."""
    run = request.getfixturevalue(f"{path}_batch")
    text = run.outcomes["network"].outputs
    assert f"{attacks.NET_MARK} interfaces ['lo']" in text, text[-3000:]
    assert f"{attacks.NET_MARK} routes 0 " in text, text[-3000:]
    assert run.network_targets, "the network attack was aimed at nothing"
    for host, port in run.network_targets:
        assert f"{attacks.NET_MARK} blocked {host} {port} " in text, f"{host} {port}: {text[-3000:]}"
    assert "CONNECTED" not in text
    assert run.listener_connections == 0
    if all(host == "::1" or host.startswith("127.") for host, _ in run.network_targets):
        request.node.warn(pytest.PytestWarning("this host has no address but loopback: the network attack was "
                                               "aimed at the host's loopback (outside the sandbox) only"))


@pytest.mark.parametrize("path", paths_playing("read_sources"))
def test_each_path_plays_the_kernel_it_runs(request, path):
    """The root run's grade path execs its kernels (the grading API; ``DDP_COURSE_ZYGOTE=0``); autograde forks them
    from a zygote, and so does the rootless replay's grade path (``DDP_COURSE_ADVERSARIAL_FORK=1``: ``ddp-course
    grade`` and ``autograde`` without root): a kernel the zygote ran in place keeps the module's name."""
    text = request.getfixturevalue(f"{path}_batch").outcomes["read_sources"].outputs
    name = re.search(rf"{attacks.READ_MARK} kernel process (\S+)", text)
    assert name, text[-3000:]
    forked = path == "autograde" or os.environ.get("DDP_COURSE_ADVERSARIAL_FORK") == "1"
    assert (name.group(1) == "ipykernel_launc") if forked else name.group(1).startswith("python"), (path, name.group(1))


@pytest.mark.parametrize("path", paths_playing("output_flood"))
def test_flood_is_cut_and_kept_small(request, path):
    run = request.getfixturevalue(f"{path}_batch")
    assert len(run.outcomes["output_flood"].outputs) < 8 << 20


@pytest.mark.parametrize("path", paths_playing("leak_history"))
def test_hidden_tests_never_reach_what_the_student_sees(request, path):
    """A notebook that records every cell its kernel runs and prints what the kernel remembers of them
    (``_ih``, ``In``, linecache, history, a pre_run_cell hook, its folder's files) shows visible tests only."""
    run = request.getfixturevalue(f"{path}_batch")
    text = run.outcomes["leak_history"].outputs
    # it ran and saw the cells the kernel ran (the imports; the kernel runs no check, only a comment per test cell)
    assert f"{attacks.LEAK_MARK} import graders." in text, text[-3000:]
    assert "HIDDEN TESTS" not in text
    for line in attacks.hidden_lines(run.source):
        assert line not in text, f"{path}: hidden test shown to the student: {line}"


@pytest.mark.skipif("autograde" not in PATHS, reason="the autograde path is not played in this run")
def test_feedback_shows_no_hidden_tests(autograde_batch):
    from runs import FEEDBACK_STUDENTS

    feedback = autograde_batch.extra["feedback"]
    assert feedback.returncode == 0, feedback.stdout[-3000:] + feedback.stderr[-3000:]
    students = [s for s in FEEDBACK_STUDENTS if s in autograde_batch.outcomes]  # all three in the root run
    assert "honest" in students
    for student in students:
        page = autograde_batch.extra["feedback_pages"][student]
        assert "passed" in page or "FAILED" in page, f"{student}: no feedback page"
        for line in attacks.hidden_lines(autograde_batch.source):
            assert line not in page, f"{student}'s feedback shows a hidden test: {line}"


@pytest.mark.skipif("autograde" not in PATHS, reason="the autograde path is not played in this run")
def test_autograde_says_how_notebooks_are_isolated(autograde_batch):
    first = f"sandbox: {sandbox_kind()}"
    assert first in autograde_batch.extra["stdout"], autograde_batch.extra["stdout"][-3000:]
