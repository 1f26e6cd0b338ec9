"""``ddp-course demo``, the README's main job, runs end to end: init, release, sample submissions, autograde,
grades; the reference student gets full marks and the untouched one nothing."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import submissions


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_grades_a_sample_class(tmp_path):
    root = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "course.cli", "demo", str(root), "--assignment", "ex1-parallelism",
                           "--students", "3"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "5. grades" in proc.stdout
    with open(root / "grades.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3, rows
    scores = sorted(float(r["score"]) for r in rows)
    maximum = {float(r["max_score"]) for r in rows}
    # from the notebooks (every sample student hands in each of them), not a copy of their total
    top = sum(sum(submissions.full_marks("ex1-parallelism", nb).values())
              for nb in submissions.notebooks("ex1-parallelism"))
    assert maximum == {top}, rows
    assert scores[0] < scores[-1] == top, rows  # someone is right, someone is not

    # the class report on the demo class: its tables, each check named by what it checks, the page with its plots
    import os

    report = subprocess.run([sys.executable, "-m", "course.cli", "report", "-C", str(root)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    out = " ".join(report.stdout.replace("│", " ").split())
    assert "ex1_test_shards: Every row of the global batch is on exactly one rank" in out, out
    assert "ex1-parallelism 3 3" in out, out  # submitted 3, graded 3
    page = (root / "report.html").read_text()
    assert all(f'<table id="{name}">' in page for name in ("assignments", "checks", "students", "grading-time"))
    assert page.count("<svg") == 3 and "ex1_test_two_stage" in page
