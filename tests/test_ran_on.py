"""The grade report says which backend each check's jobs used (issue 39, item 4), on a CPU machine.

course.checks.run notes each job's backend ("gloo, GPUs hidden" by the check API's policy, "nccl" or "gloo" for a
check that asks for ``backend="auto"``); the verifier collects them per test cell; the graded notebook's passing cell
says it, its metadata keeps it, and ``ddp-course grade`` shows it in a column and in its JSON.
"""

from __future__ import annotations

import json

import nbformat
import pytest

from course import checks
from course.grading import cells, grade, scoring, verifier


def _harness(rank):
    return rank


def test_a_checks_job_notes_gloo_with_the_gpus_hidden(monkeypatch):
    cells.RAN_ON.clear()
    assert checks.run("check_demo", _harness, 1).values == [0]
    assert cells.RAN_ON == ["gloo, GPUs hidden"]
    monkeypatch.setattr(checks, "resolve_backend", lambda name, world_size: "nccl")  # a GPU per rank
    monkeypatch.setattr(checks, "launch", lambda *a, **k: None)
    checks.run("check_gpu", _harness, 2, backend="auto")
    assert cells.RAN_ON == ["gloo, GPUs hidden", "nccl"]


def test_the_verifier_gives_each_cell_what_its_own_jobs_ran_on(monkeypatch):
    def fake_cell(request, timeout):
        for backend, hidden in request["jobs"]:
            cells.note_ran_on(backend, hidden)
        return {"index": request["index"], "status": "passed"}

    monkeypatch.setattr(verifier, "_verify_cell", fake_cell)
    cells.note_ran_on("nccl", False)  # an earlier cell's job: not this cell's
    first = verifier.verify_noting_backends({"index": 1, "jobs": [("gloo", True), ("gloo", True)]}, 10)
    second = verifier.verify_noting_backends({"index": 2, "jobs": []}, 10)
    assert first["ran_on"] == ["gloo, GPUs hidden"] and second["ran_on"] == []


def _graded_cell(gid: str):
    cell = nbformat.v4.new_code_cell("graders.parallelism.check_x(f)")
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": gid, "points": 2, "solution": False}
    cell.execution_count = 1
    return cell


def test_the_report_shows_the_backend_in_the_notebook_its_table_and_its_json(capsys):
    nb = nbformat.v4.new_notebook(cells=[_graded_cell("t_pass"), _graded_cell("t_fail")])
    verdicts = [verifier.Verdict(0, "t_pass", "passed", stdout="passed check_x\n", points=2,
                                 ran_on=["gloo, GPUs hidden"]),
                verifier.Verdict(1, "t_fail", "failed", message="FAILED check_x: rank 1 ...", points=2,
                                 ran_on=["gloo, GPUs hidden", "nccl"])]
    verifier.apply_verdicts(nb, verdicts)
    assert nb.cells[0].outputs[0].text == "passed check_x\n(ran on gloo, GPUs hidden)\n"  # the student's feedback
    assert [o.output_type for o in nb.cells[1].outputs] == ["error"]  # a failure's message is unchanged
    results = [scoring.score_cell(c, 2, True) for c in nb.cells]
    assert [scoring.ran_on(c) for c in nb.cells] == [["gloo, GPUs hidden"], ["gloo, GPUs hidden", "nccl"]]
    assert (results[0].score, results[1].score) == (2, 0)
    report = scoring.GradeReport("nb.ipynb", 2, 4, results, ran_on={"t_pass": ["gloo, GPUs hidden"],
                                                                     "t_fail": ["gloo, GPUs hidden", "nccl"]})
    assert json.loads(report.to_json())["ran_on"]["t_pass"] == ["gloo, GPUs hidden"]
    from course.grading.notebook import Execution
    from course.grading.restore import GradedCell

    scored = scoring.score_notebook(Execution(nb, ran={0, 1}), [GradedCell("t_pass", 2), GradedCell("t_fail", 2)], "nb")
    assert scored.ran_on == report.ran_on and scored.score == 2
    grade.print_report(report)
    out = capsys.readouterr().out
    assert "ran on" in out and "GPUs hidden" in out and "nccl" in out


@pytest.mark.parametrize("meta", [{}, {"ddp_course": {"other": 1}}])
def test_a_cell_without_a_record_has_nothing_to_show(meta):
    cell = _graded_cell("t")
    cell.metadata.update(meta)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="passed\n")]
    assert scoring.ran_on(cell) == []
