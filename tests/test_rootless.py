"""The rootless sandbox, tested as what it is for: an instructor without root (a cluster's login or compute node).

As root, this runs the adversarial suite (tests/adversarial: the sandbox's own tests, and the attacks whose
outcome can depend on running without root, on the grade path and the small exercise of tests/files/verify)
again as an unprivileged user (``nobody``, through ``setpriv``), where :class:`course.sandbox.Sandbox` isolates
with a user namespace instead of a uid of its own. Which attacks, and why the others cannot end otherwise
without root, is the table above ``ATTACKS`` in tests/adversarial/attacks.py (its ``rootless`` column). It skips
where that user cannot run this Python (a Python under /root, mode 0700) or setpriv is missing, unless
DDP_COURSE_REQUIRE_ROOTLESS=1 (CI, which makes this Python reachable), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requirements_gate

ROOT = Path(__file__).resolve().parents[1]
USER = 65534  # nobody
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
#: files of tests/adversarial the replay leaves out: their outcome cannot depend on running without root (below)
SAME_WITHOUT_ROOT = ("test_forged_evidence.py", "test_forged_residual.py")


def _as_user(argv: list[str], env: dict, timeout: float, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "env", "-i",
                           *(f"{k}={v}" for k, v in env.items()), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _gate(env: dict) -> None:
    def unavailable(reason):
        requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_ROOTLESS")

    if os.geteuid() != 0:
        pytest.skip("not root: tests/adversarial runs rootless as it is")
    if not shutil.which("setpriv"):
        unavailable("setpriv (util-linux) is missing")
    probe = _as_user([sys.executable, "-c", "from course.sandbox import rootless_available as r; "
                                            "ok, why = r(); print(ok, why)"], env, 60, cwd=str(ROOT))
    if probe.returncode != 0:
        unavailable(f"an unprivileged user cannot run {sys.executable} here: {probe.stderr.strip()[-300:]}")
    if not probe.stdout.startswith("True"):
        unavailable(f"no rootless sandbox for an unprivileged user here: {probe.stdout.strip()}")


def test_the_adversarial_suite_holds_without_root():
    home = tempfile.mkdtemp(prefix="ddp-course-rootless-home-")
    os.chmod(home, 0o777)  # noqa: S103 - the unprivileged user's home for this run (its caches), removed after
    env = {"HOME": home, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1",
           **{k: v for k, v in os.environ.items() if k.startswith("DDP_COURSE_") and k != "DDP_COURSE_REQUIRE_ROOTLESS"},
           # the attacks on the small exercise: what this run tests is the sandbox without root, and the root run
           # (tests/adversarial itself) already plays every attack against exercise 1's real checks
           "DDP_COURSE_ADVERSARIAL_BASE": "tiny",
           # and on the grade path alone: both paths grade in the same sandbox, which is what this run tests
           "DDP_COURSE_ADVERSARIAL_PATHS": "grade",
           # its kernels and verifiers forked from a zygote, as `ddp-course grade` and `autograde` start them for an
           # instructor without root (the root run plays the exec'd grade path and the forked autograde path)
           "DDP_COURSE_ADVERSARIAL_FORK": "1",
           # only the attacks whose outcome running without root can change (the sandbox's isolation, limits and
           # kills); the others (nbgrader's and restore's handling of the notebook, patches that stay in the
           # kernel's memory, the output cap in the grader) end the same whatever the sandbox: the root run plays them
           "DDP_COURSE_ADVERSARIAL_PLAY": "rootless"}
    try:
        _gate(env)
        # not the Docker path's attacks (test_docker_attacks.py): they grade in the grader container, whose engine
        # this user does not reach, and they play the container's partial sandbox, not this one
        # nor the forgeries whose defences ask the kernel for nothing a uid changes (no sandbox, no seal: the
        # checks' own evidence, in ranks of the grader's user either way); the ex2 forgeries stay, their step plan
        # and cost are refused by a seccomp seal, which an unprivileged process sets up otherwise (no_new_privs)
        ignored = [f"--ignore=tests/adversarial/{name}" for name in SAME_WITHOUT_ROOT]
        run = _as_user([sys.executable, "-m", "pytest", "tests/adversarial", *ignored, "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "-rs", "-n", "0", "-m", "not docker"], env, 1700, cwd=str(ROOT))  # in one process: this test is one xdist unit
    finally:
        shutil.rmtree(home, ignore_errors=True)
    tail = run.stdout[-6000:] + run.stderr[-3000:]
    print(tail)
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
    # the rootless tests ran (they skip as root), and the isolation tests were not skipped for want of it
    assert "needs root, or user namespaces" not in run.stdout, tail
    assert "the rootless sandbox is for a non-root user" not in run.stdout, tail


def test_the_files_the_replay_leaves_out_use_no_sandbox_and_no_seal():
    """What makes a forgery's outcome the same without root: the test makes no sandbox, and calls no check of a
    grader module that seals the student's thread (the ex2 forgeries, whose checks do, are replayed)."""
    import re

    sealed = set()  # the checks defined in a module that seals
    for path in (ROOT / "graders").rglob("*.py"):
        text = path.read_text()
        if re.search(r"\bsealing\b|\brefuse\(", text):
            sealed |= set(re.findall(r"^def (check_\w+)", text, flags=re.M))
    assert {"check_step_cost", "check_step_plan", "check_zero_memory"} <= sealed  # the rule sees them
    for name in SAME_WITHOUT_ROOT:
        text = (ROOT / "tests" / "adversarial" / name).read_text()
        assert not {c for c in sealed if re.search(rf"\b{c}\b", text)}, name
        assert not re.search(r"\bSandbox\b|rootless|geteuid|ddp-course", text), name
    replayed = (ROOT / "tests" / "adversarial" / "test_forged_ex2_cost.py").read_text()
    assert "refused by the grader's sandbox" in replayed  # the seal, which the replay must see hold as nobody
