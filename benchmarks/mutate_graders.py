"""Mutation run over the graders' assertions: which failure of a check can no test see?

Each mutant switches off one assertion of a grader module:

* ``expect(COND, ...)`` becomes ``expect(True, ...)`` (the check no longer fails there);
* ``raise CheckFailed(...)`` becomes ``pass``.

For every mutant the given tests run on a copy of the repository (``pytest -x -n 0``). A mutant the tests
kill (they fail) is an assertion some test proves; a mutant that survives is one no test can tell from a
no-op: either a test is missing, or the assertion can never fire. The baseline (no mutation) must pass first.

    python benchmarks/mutate_graders.py graders/ddp_from_scratch/cost.py tests/test_graders_ex2_cost.py
    python benchmarks/mutate_graders.py graders/parallelism/checks.py tests/test_graders_ex1.py --line 120 --json out.json

One mutant at a time (the tests start multi-rank jobs: this machine has 2 cores). The report lists each
site (line, kind, the assertion's first line), killed or survived, and the seconds it took.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the copy holds (the tests read exercises, lessons and their files from the repository root)
COPIED = ("course", "graders", "tests", "exercises", "lessons", "pyproject.toml")


@dataclass
class Site:
    """One assertion of a module: where it is and how it is switched off."""

    line: int
    kind: str  # "expect" or "raise"
    text: str  # its first line, as written
    start: int  # byte offsets of the text replaced
    end: int
    replacement: str


@dataclass
class Result:
    line: int
    kind: str
    text: str
    outcome: str  # "killed", "survived", "timeout"
    seconds: float
    failed: str = ""  # the first test that failed (a killed mutant)


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def sites(source: str) -> list[Site]:
    """Every ``expect(...)`` call and ``raise CheckFailed(...)`` statement of ``source``, in order."""
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + col

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _name(node.func) == "expect" and node.args:
            arg = node.args[0]
            found.append(Site(node.lineno, "expect", "", offset(arg.lineno, arg.col_offset),
                              offset(arg.end_lineno, arg.end_col_offset), "True"))
        elif (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
              and _name(node.exc.func) == "CheckFailed"):
            found.append(Site(node.lineno, "raise", "", offset(node.lineno, node.col_offset),
                              offset(node.end_lineno, node.end_col_offset), "pass"))
    lines = source.splitlines()
    for site in found:
        site.text = lines[site.line - 1].strip()
    return sorted(found, key=lambda s: (s.line, s.start))


def mutate(source: str, site: Site) -> str:
    data = source.encode()
    return (data[:site.start] + site.replacement.encode() + data[site.end:]).decode()


def copy_repo(dest: Path, root: Path = ROOT) -> None:
    """The parts of the repository the tests need, readable by the sandboxes' users (their own uids)."""
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    for folder in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        os.chmod(folder, 0o755)


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``copy``: ("passed" | "failed" | "timeout", seconds, the first failing test, or else the
    end of pytest's output)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
                               "-o", "addopts=", *tests], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    failed = next((line.split(" ", 2)[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))),
                  (proc.stdout + proc.stderr)[-1500:])
    if proc.returncode == 5:
        raise SystemExit(f"pytest collected no tests from {tests}")
    return ("passed" if proc.returncode == 0 else "failed"), seconds, failed


def run(module: str, tests: list[str], *, lines: set[int] | None = None, timeout: float = 900,
        root: Path = ROOT, echo=print) -> list[Result]:
    """Every mutant of ``module`` (a path under ``root``) against ``tests``; the baseline must pass first."""
    source = (root / module).read_text()
    chosen = [s for s in sites(source) if not lines or s.line in lines]
    results = []
    with tempfile.TemporaryDirectory(prefix="ddp-course-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        copy_repo(copy, root)
        outcome, seconds, failed = run_tests(copy, tests, timeout)
        if outcome != "passed":
            raise SystemExit(f"the baseline does not pass ({outcome}): fix it first; first failure: {failed}")
        echo(f"baseline passed in {seconds:.0f} s; {len(chosen)} mutants of {module}")
        target = copy / module
        for site in chosen:
            target.write_text(mutate(source, site))
            outcome, seconds, failed = run_tests(copy, tests, timeout)
            verdict = {"failed": "killed", "passed": "survived"}.get(outcome, outcome)
            results.append(Result(site.line, site.kind, site.text, verdict, round(seconds, 1), failed))
            echo(f"{verdict:9s} {module}:{site.line} {site.kind:6s} {site.text[:90]} ({seconds:.0f} s)")
        target.write_text(source)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="a grader module, relative to the repository (graders/ddp_from_scratch/cost.py)")
    parser.add_argument("tests", nargs="+", help="pytest paths or node ids that should catch its mutants")
    parser.add_argument("--line", type=int, action="append", help="only the assertion(s) on these lines")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one run of the tests")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = run(args.module, args.tests, lines=set(args.line or []), timeout=args.timeout)
    killed = sum(r.outcome == "killed" for r in results)
    print(f"{killed}/{len(results)} mutants killed; survivors (assertions no test sees):")
    for r in results:
        if r.outcome != "killed":
            print(f"  {args.module}:{r.line} {r.kind}: {r.text} [{r.outcome}]")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
