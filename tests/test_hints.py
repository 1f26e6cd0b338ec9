"""Hints that escalate (issue 40, item 4): a failed check first says what is wrong; asked, it gives the idea and the
lesson section (level 2), then where the student's code breaks it (level 3); no level shows solution code, and
every request is recorded beside the notebook."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import nbformat
import pytest
from click.testing import CliRunner

from course.errors import SHOWN, CheckFailed
from course.grading import hints
from course.student import check as self_check
from course.student.hint import hint

ROOT = Path(__file__).resolve().parent.parent
GRADERS = ROOT / "graders"
PACKAGES = sorted(p.name for p in GRADERS.iterdir() if (p / "__init__.py").is_file() and p.name != "common")


def _failure(**kwargs) -> CheckFailed:
    """A failure of a real check, as its package raises it (its package found from the stack, as in a check)."""
    exec_globals = {"__name__": "graders.parallelism.checks", "CheckFailed": CheckFailed, "kwargs": kwargs}
    exec("err = CheckFailed('check_shards', 'rank 1 got rows rank 0 has', ranks=[1], **kwargs)", exec_globals)
    return exec_globals["err"]


HINT = "slice the batch with the rank's own start and stop"


def test_level_one_says_what_is_wrong_without_the_fix():
    err = hints.attach(_failure(expected="disjoint rows", got="rows 0, 1 twice", hint=HINT, detail="evidence"))
    first = err.render(1)
    assert "FAILED check_shards [rank 1]: rank 1 got rows rank 0 has" in first
    assert "expected: disjoint rows" in first and "got:      rows 0, 1 twice" in first and "evidence" in first
    assert "try:" not in first and HINT not in first and "idea:" not in first
    assert 'course.hint("check_shards")' in first and "ddp-course check parallelism.ipynb --hint check_shards" in first
    second = err.render(2)
    assert "idea:" in second and 'section "3. Data parallelism: split the batch"' in second
    assert "lessons/01-data-vs-model-parallelism.ipynb" in second and HINT not in second and "more:" in second
    third = err.render(3)
    assert f"try:      {HINT}" in third and "more:" not in third
    assert err.render(7) == third and str(err) == err.render(None) and HINT in str(err)


def test_a_failure_knows_its_package_under_an_instructors_own_root_too(monkeypatch):
    from course import envnames, errors

    assert errors.CHECK_PACKAGES_ENV == envnames.CHECK_PACKAGES_ENV
    monkeypatch.setenv(envnames.CHECK_PACKAGES_ENV, "mycourse_checks")
    where = {"__name__": "mycourse_checks.mean", "CheckFailed": CheckFailed}
    exec("err = CheckFailed('check_mean', 'the ranks do not all hold the mean', hint='divide')", where)
    err = hints.attach(where["err"])
    assert err.package == "mycourse_checks.mean" and err.concept is None
    assert "ddp-course check mean.ipynb --hint check_mean" in err.render(1)
    assert "try:      divide" in err.render(2)  # no concepts: level 2 goes on to what to try


def test_a_failure_of_code_not_written_yet_needs_no_hint():
    err = hints.attach(_failure(hint="replace `raise NotImplementedError()` with your code"))
    err.problem = "`shard_batch` is not written yet: it only raises NotImplementedError"
    assert err.deepest == 1 and err.render(1) == err.render(3)
    assert "more:" not in err.render(1) and "try:" not in err.render(1)


def test_the_notebook_shows_level_one_and_course_hint_escalates_to_three(tmp_path, monkeypatch):
    import sys

    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    err = _failure(expected="disjoint rows", got="rows twice", hint=HINT)
    # the shell installs its namespace as sys.modules["__main__"] (without __spec__, which multiprocessing reads
    # when a later test in this process starts ranks): put the test process's own back afterwards
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    shell = InteractiveShell.instance()
    try:
        shell.user_ns["err"] = err
        with capture_output() as shown:
            shell.run_cell("raise err", store_history=False)
    finally:
        InteractiveShell.clear_instance()
    assert "FAILED check_shards" in shown.stdout and "more:" in shown.stdout and HINT not in shown.stdout
    assert SHOWN[-1] is err
    texts = [hint("check_shards", folder=str(tmp_path)) for _ in range(4)]
    assert [t.splitlines()[0] for t in texts] == ["hint level 2 of 3 for check_shards:"] + [
        "hint level 3 of 3 (the last) for check_shards:"] * 3
    assert "idea:" in texts[0] and HINT not in texts[0] and f"try:      {HINT}" in texts[1]
    requests = json.loads((tmp_path / hints.RECORD).read_text())["requests"]
    assert [(r["check"], r["level"], r["asked_in"], r["notebook"]) for r in requests] == [
        ("check_shards", level, "notebook", "parallelism.ipynb") for level in (2, 3, 3, 3)]
    assert all(re.match(r"\d{4}-\d\d-\d\dT", r["at"]) for r in requests)
    assert "no failure of `check_other`" in hint("check_other", folder=str(tmp_path))
    assert len(json.loads((tmp_path / hints.RECORD).read_text())["requests"]) == 4


def test_another_failure_of_the_same_check_starts_again_at_level_two(tmp_path):
    first = _failure(hint=HINT)
    first._render_traceback_()
    hint("check_shards", folder=str(tmp_path))
    assert hint("check_shards", folder=str(tmp_path)).startswith("hint level 3")
    other = _failure(hint=HINT, expected="x")
    other.problem = "the shares differ by 2 rows"
    other._render_traceback_()
    assert hint(folder=str(tmp_path)).startswith("hint level 2")


# --------------------------------------------------------------------------- the self-check


def _report(tmp_path) -> self_check.CheckReport:
    err = hints.attach(_failure(expected="disjoint rows", got="rows twice", hint=HINT))
    cell = self_check.CheckedCell("ex1_test_shards", 0.0, 2.0, err.render(1), check="check_shards")
    return self_check.CheckReport(str(tmp_path / "parallelism.ipynb"), 0.0, 2.0, [cell], [], {
        "ex1_test_shards": {"check": "check_shards", "package": "graders.parallelism", "levels": hints.levels(err)}})


def test_the_self_check_shows_level_one_and_gives_the_next_level_when_asked(tmp_path, monkeypatch):
    notebook = tmp_path / "parallelism.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), notebook)
    monkeypatch.setattr(self_check, "check_notebook", lambda *a, **k: _report(tmp_path))
    plain = CliRunner().invoke(self_check.command, [str(notebook)])
    assert plain.exit_code == 0 and "more:" in plain.output and HINT not in plain.output
    assert "idea:" not in plain.output and not (tmp_path / hints.RECORD).exists()
    outputs = [CliRunner().invoke(self_check.command, [str(notebook), "--hint", "check_shards"]).output
               for _ in range(3)]
    assert "hint level 2 for check_shards" in outputs[0] and "idea:" in outputs[0] and HINT not in outputs[0]
    assert all("hint level 3" in out and f"try:      {HINT}" in out for out in outputs[1:])
    requests = json.loads((tmp_path / hints.RECORD).read_text())["requests"]
    assert [(r["level"], r["asked_in"]) for r in requests] == [(2, "check"), (3, "check"), (3, "check")]
    asked = json.loads(CliRunner().invoke(self_check.command,
                                          [str(notebook), "--json", "--hint", "check_shards"]).output)
    assert asked["hint"]["level"] == 3 and "hints" not in asked
    none = CliRunner().invoke(self_check.command, [str(notebook), "--hint", "check_other"]).output
    assert "no hint for check_other: it did not fail in this run" in none


def test_the_verifier_writes_level_one_and_keeps_the_other_levels(monkeypatch):
    from course.grading import verifier

    def fake_resolve(call):
        def check(*args):
            raise _failure(expected="disjoint rows", got="rows twice", hint=HINT)
        return check

    monkeypatch.setattr(verifier, "_resolve", fake_resolve)
    result = verifier._verify_cell({"index": 3, "source": "graders.parallelism.check_shards(1)"}, 30)
    assert result["status"] == "failed" and "more:" in result["message"] and HINT not in result["message"]
    assert result["check"] == "check_shards" and result["package"] == "graders.parallelism"
    assert result["levels"][0] == result["message"] and HINT in result["levels"][2] and "idea:" in result["levels"][1]


# --------------------------------------------------------------------------- level 2 covers every check


def _headings(lesson: str) -> set[str]:
    nb = nbformat.read(ROOT / "lessons" / f"{lesson}.ipynb", as_version=4)
    return {line.lstrip("#").strip() for cell in nb.cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_check_has_an_idea_and_a_lesson_section_that_exists(package):
    from graders.common.concepts import CONCEPTS

    exports = importlib.import_module(f"graders.{package}").EXPORTS
    checks = {name for name in exports if name.startswith("check_")}
    assert checks <= set(CONCEPTS.get(package, {})), f"no level 2 for {sorted(checks - set(CONCEPTS.get(package, {})))}"
    assert set(CONCEPTS[package]) <= checks, "an entry for a check the package does not offer"
    for check, (idea, lesson, section) in CONCEPTS[package].items():
        assert idea and (ROOT / "lessons" / f"{lesson}.ipynb").is_file(), check
        assert section in _headings(lesson), f"{check}: no heading {section!r} in {lesson}"
        assert hints.concept_of(f"graders.{package}", check) == (idea, lesson, section)


# --------------------------------------------------------------------------- no level shows solution code


def _notebook_of(package: str) -> Path:
    found = sorted((ROOT / "exercises").glob(f"*/{package}.ipynb"))
    assert len(found) == 1, package
    return found[0]


def solution_lines(package: str) -> set[str]:
    """Every line (stripped, 15 characters or more) of the notebook's ``### BEGIN SOLUTION`` regions."""
    lines, inside = set(), False
    for cell in nbformat.read(_notebook_of(package), as_version=4).cells:
        for line in cell.source.splitlines():
            text = line.strip()
            if text.startswith("### BEGIN SOLUTION"):
                inside = True
            elif text.startswith("### END SOLUTION"):
                inside = False
            elif inside and len(text) >= 15:
                lines.add(text)
    return lines


def message_literals(package: str) -> set[str]:
    """Every string literal of the modules that can build a level-1 message of ``package``'s checks: its own, the
    shared ``graders.common`` and the check API's (a superset of what problem, expected, got and detail can hold:
    every constant, f-strings' parts included, but docstrings and what is written as a call's ``hint=``, level 3)."""
    paths = [*(GRADERS / package).rglob("*.py"), *(GRADERS / "common").rglob("*.py"),
             *(ROOT / "course" / "checks").rglob("*.py"), ROOT / "course" / "errors.py"]
    found = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        level3 = {id(inner) for node in ast.walk(tree) for part in _hint_arguments(node) for inner in ast.walk(part)}
        found |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and id(node) not in docstrings | level3}
    return found


def _hint_arguments(node: ast.AST) -> list[ast.AST]:
    """What is written as level 3: a call's ``hint=`` or ``hints=`` (and a :class:`course.checks.Mistake`'s third
    argument, its hint), a value given a name that ends in ``hint`` or ``hints``, what a function named ``..._hint``
    returns."""
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.endswith(("hint", "hints"))
                                            for t in node.targets):
        return [node.value]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith("_hint"):
        return [part.value for part in ast.walk(node) if isinstance(part, ast.Return) and part.value is not None]
    if not isinstance(node, ast.Call):
        return []
    parts = [kw.value for kw in node.keywords if kw.arg in ("hint", "hints")]
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    if name == "Mistake" and len(node.args) >= 3:
        parts.append(node.args[2])
    return parts


@pytest.mark.parametrize("package", PACKAGES)
def test_no_first_level_message_holds_a_line_of_the_reference_solution(package):
    from graders.common.concepts import CONCEPTS

    lines = solution_lines(package)
    assert lines, f"{package}: no solution lines found"
    literals = message_literals(package) | {idea for idea, _, _ in CONCEPTS[package].values()}
    leaks = sorted((line, text[:120]) for line in lines for text in literals if line in text)
    assert not leaks, leaks


def _wrong_shard_batch(batch, rank, world_size):
    return batch[: len(batch) // world_size]  # every rank takes the first rows


def _last_rank_takes_the_rest(batch, rank, world_size):
    base = len(batch) // world_size
    return batch[rank * base:] if rank == world_size - 1 else batch[rank * base:(rank + 1) * base]


def _wrong_average_gradients(model, n_local):
    return None  # the gradients stay this rank's own


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check, answer", [("check_shards", _wrong_shard_batch),
                                           ("check_shard_sizes", _last_rank_takes_the_rest),
                                           ("check_average_gradients", _wrong_average_gradients)])
def test_real_failures_show_no_solution_line_at_level_one(check, answer):
    import graders.parallelism

    with pytest.raises(CheckFailed) as failed:
        getattr(graders.parallelism, check)(answer)
    err = hints.attach(failed.value)
    first = err.render(1)
    assert err.package == "graders.parallelism" and "more:" in first
    assert not err.hint or err.hint not in first
    assert not [line for line in solution_lines("parallelism") if line in first]
    assert err.concept in err.render(2) and (not err.hint or err.hint in err.render(3))


@pytest.mark.timeout(600)
def test_a_real_self_check_shows_level_one_and_the_next_levels_on_request(tmp_path):
    import submissions

    nb = submissions.patch_answer(submissions.load("ex1-parallelism"), "ex1_shard_batch",
                                  "start = rank * base + min(rank, extra)", "start = 0")
    path = submissions.write(nb, tmp_path, "ex1-parallelism")
    report = self_check.check_notebook(path, exercises=submissions.EXERCISES, in_process=True)
    failed = {t.check: t for t in report.tests if not t.passed}
    assert "check_shards" in failed, report.tests
    shown = "\n".join(self_check.report_lines(report))
    assert 'course.hint("check_shards")' in shown and "idea:" not in shown and "try:" not in shown
    assert not [line for line in solution_lines("parallelism") if line in shown]
    second, level = self_check.give_hint(report, "check_shards", path.parent)
    assert level == 2 and "idea:" in second and "try:" not in second
    third, level = self_check.give_hint(report, "check_shards", path.parent)
    assert level == 3 and "try:" in third
    assert [r["level"] for r in hints.read_record(path.parent)] == [2, 3]


def hint_literals(package: str) -> set[str]:
    """Every string literal written as level 3 in ``package``'s own modules (:func:`_hint_arguments`)."""
    found = set()
    for path in (GRADERS / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        found |= {inner.value for node in ast.walk(tree) for part in _hint_arguments(node) for inner in ast.walk(part)
                  if isinstance(inner, ast.Constant) and isinstance(inner.value, str)}
    return found


def test_no_hint_shows_a_line_of_the_reference_solution():
    """No level shows solution code: no line of a notebook's reference solution is in any hint its package writes
    (the level-3 texts, which say where the property breaks, name the API, never the line)."""
    found = {(package, line) for package in PACKAGES for line in solution_lines(package)
             for text in hint_literals(package) if line in text}
    assert found == set(), "a hint shows solution code"

