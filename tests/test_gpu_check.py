"""benchmarks/gpu_check.sh and its Python parts (benchmarks/gpu_check.py) on a CPU machine: the plan, the
expectations for 0, 1 and several GPUs, the summary, the script's order and time budget (dry run), and one exercise
graded through the real pipeline with the 'auto' policy (on CPUs: gloo, the GPUs not hidden since there are none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.parametrize("gpus, policy, ran_on, ok", [
    (4, "auto", ["nccl"], True),
    (4, "auto", ["gloo", "nccl"], True),  # the hidden tests' 8-rank job falls back to gloo
    (4, "auto", ["gloo"], False),
    (1, "auto", ["gloo"], True),
    (1, "auto", ["nccl"], False),  # every check runs 2 ranks or more: one GPU cannot give them nccl
    (0, "auto", ["gloo"], True),
    (0, "auto", ["gloo, GPUs hidden"], False),  # the policy override did not reach the check
    (4, "gloo", ["gloo, GPUs hidden"], True),
    (4, "gloo", ["gloo, GPUs hidden", "nccl"], False),
    (2, "auto", [], False),
])
def test_what_each_gpu_count_must_give(gpus, policy, ran_on, ok):
    assert (gpu_check.expected(gpus, policy, ran_on) == "") is ok


def test_the_plan_keeps_each_exercises_first_test_and_nothing_after():
    from course.grading.cells import is_test_cell
    from course.grading.notebook import read

    rows = gpu_check.verifier_part("auto", 2, dry_run=True)
    assert [r["exercise"] for r in rows] == ["ex1-parallelism", "ex2-ddp-basics", "ex3-syncbn-sharding",
                                             "ex4-torchrun"]
    for row in rows:
        cut, test = gpu_check.cut_after_first_test(read(Path(row["path"])))
        assert [is_test_cell(c) for c in cut.cells].count(True) == 1 and is_test_cell(cut.cells[-1])
        assert test == row["test"] and len(cut.cells) == row["cells"]


def test_the_summary_names_each_part_and_what_failed(tmp_path):
    (tmp_path / "part-gpu.exit").write_text("0\n")
    (tmp_path / "gpu.log").write_text("...\n========== 9 passed, 1 skipped in 41.0s ==========\n")
    (tmp_path / "part-verifier.exit").write_text("1\n")
    (tmp_path / "verifier.json").write_text(json.dumps([
        {"exercise": "ex1-parallelism", "ok": True},
        {"exercise": "ex3-syncbn-sharding", "ok": False, "problem": "expected nccl with 2 GPUs, got ['gloo']"}]))
    (tmp_path / "part-lessons.exit").write_text("124\n")
    text, code = gpu_check.summary(tmp_path)
    assert code == 1
    assert "gpu        exit 0; 9 passed, 1 skipped in 41.0s" in text
    assert "verifier   exit 1; 1/2 ok\n    FAILED ex3-syncbn-sharding: expected nccl with 2 GPUs" in text
    assert "lessons    exit 124" in text and text.endswith("2 part(s) failed")
    assert gpu_check.summary(tmp_path / "none") == ("no part ran", 1)


def _dry(tmp_path, **env):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "GPU_CHECK_DRY_RUN": "1", **env})
    return proc, (tmp_path / "summary.txt").read_text()


def test_the_script_runs_its_parts_one_after_another_within_its_budget(tmp_path):
    proc, summary = _dry(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [line.split("start ", 1)[1].split(" ", 1)[0] for line in summary.splitlines() if "] start " in line]
    assert starts == ["gpu", "sandbox", "verifier", "lessons"]
    assert "--policy auto" in summary and "-k not lesson" in summary and "-k lesson" in summary
    assert summary.rstrip().endswith("all parts passed")
    _, small = _dry(tmp_path / "small", GPU_CHECK_BUDGET="100", GPU_CHECK_PARTS="gpu lessons policy")
    limits = [int(line.split("(limit ", 1)[1].split("s)", 1)[0]) for line in small.splitlines() if "(limit " in line]
    assert limits and all(limit <= 100 for limit in limits)


def test_one_exercise_through_the_grading_pipeline_with_the_auto_policy(monkeypatch):
    """The real pipeline (sandboxed kernel, verifier) on CPUs: 'auto' reaches the check (gloo, not 'GPUs hidden'),
    the verdict passes, and the report's 'ran on' is what 0 GPUs must give."""
    monkeypatch.setenv(gpu_check.POLICY_ENV, "")
    [row] = gpu_check.verifier_part("auto", 0, only=("ex1-parallelism",), test_timeout=120)
    assert row["ok"], row
    assert row["ran_on"] == ["gloo"] and row["score"] == 1.0
