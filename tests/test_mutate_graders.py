"""benchmarks/mutate_graders.py: a mutant no test kills is reported as a survivor, one a test kills is not."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutate_graders  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MODULE = textwrap.dedent('''
    class CheckFailed(Exception):
        pass


    def expect(ok, check, problem):
        if not ok:
            raise CheckFailed(f"{check}: {problem}")


    def check_positive(x):
        expect(x > 0
               and x == x, "check_positive", "not positive")


    def check_small(x):
        if x > 10:
            raise CheckFailed("check_small: too big")
''')

TESTS = textwrap.dedent('''
    import pytest
    from graders import fake


    def test_a_negative_number_fails():
        with pytest.raises(fake.CheckFailed):
            fake.check_positive(-1)


    def test_a_small_number_passes():
        fake.check_small(3)  # nothing here ever makes check_small fail: its raise is never seen
''')


def _fake_repo(root: Path, tests: str = TESTS) -> None:
    (root / "graders").mkdir(parents=True)
    (root / "graders" / "__init__.py").write_text("")
    (root / "graders" / "fake.py").write_text(MODULE)
    (root / "tests").mkdir()
    (root / "tests" / "test_fake.py").write_text(tests)


def test_sites_switch_off_each_expect_and_raise_and_nothing_else():
    found = mutate_graders.sites(MODULE)
    assert [(s.kind, s.text) for s in found] == [
        ("raise", 'raise CheckFailed(f"{check}: {problem}")'),
        ("expect", "expect(x > 0"),
        ("raise", 'raise CheckFailed("check_small: too big")'),
    ]
    mutant = mutate_graders.mutate(MODULE, found[1])
    assert "expect(True, \"check_positive\", \"not positive\")" in mutant  # the whole two-line condition
    assert mutate_graders.mutate(MODULE, found[2]).endswith("    if x > 10:\n        pass\n")
    compile(mutant, "fake.py", "exec")


def test_a_raise_no_test_reaches_survives_and_the_rest_are_killed(tmp_path):
    _fake_repo(tmp_path)
    results = mutate_graders.run("graders/fake.py", ["tests/test_fake.py"], root=tmp_path, timeout=60,
                                 echo=lambda *a: None)
    assert [(r.line, r.kind, r.outcome) for r in results] == [
        (8, "raise", "killed"), (12, "expect", "killed"), (18, "raise", "survived")]
    assert results[0].failed == "tests/test_fake.py::test_a_negative_number_fails"
    assert (tmp_path / "graders" / "fake.py").read_text() == MODULE  # the repository itself is never mutated


def test_a_baseline_that_fails_stops_the_run(tmp_path):
    _fake_repo(tmp_path, TESTS + "\n\ndef test_broken():\n    assert False\n")
    with pytest.raises(SystemExit, match="baseline does not pass"):
        mutate_graders.run("graders/fake.py", ["tests/test_fake.py"], root=tmp_path, timeout=60,
                           echo=lambda *a: None)
