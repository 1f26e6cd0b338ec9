"""How long the read-only instructor verbs take for a class of 10: ``status`` and ``export``.

    python benchmarks/instructor_bench.py [--students 10] [--repeat 3] [--grade]

A course made from the tiny test exercises (tests/files/exercises), ``--students`` notebooks collected (and
autograded with ``--grade``); then each verb runs as an instructor runs it, a fresh ``ddp-course`` process,
median of ``--repeat`` runs, next to a baseline run of the same verb that builds the RFC 3987 grammar at import
(what every verb paid before :func:`course.cli.skip_iri_grammar`). One run, one table: timings on a shared
2-core machine are noisy; compare within the table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "files" / "exercises"
#: the baseline: the verb as it ran before, with jsonschema's optional iri grammar built at import
BASELINE = "import sys, rfc3987_syntax; from course.cli import main; sys.argv[0] = 'ddp-course'; main()"
OURS = "import sys; from course.cli import main; sys.argv[0] = 'ddp-course'; main()"


def timed(code: str, args: list[str], cwd: Path) -> float:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ddp-course {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--grade", action="store_true", help="autograde the class first (slower to set up)")
    args = parser.parse_args()

    import nbformat

    with tempfile.TemporaryDirectory(prefix="ddp-instructor-bench-") as tmp:
        course = Path(tmp) / "course"
        incoming = Path(tmp) / "incoming"
        incoming.mkdir()
        subprocess.run(["ddp-course", "init", str(course), "--exercises", str(TINY)], check=True, capture_output=True)
        subprocess.run(["ddp-course", "release"], cwd=course, check=True, capture_output=True)
        for released in sorted((course / "release").glob("*/*.ipynb")):
            nb = nbformat.read(released, as_version=4)
            for i in range(args.students):
                nbformat.write(nb, incoming / f"student{i:02d}_{released.stem}.ipynb")
        subprocess.run(["ddp-course", "collect", str(incoming)], cwd=course, check=True, capture_output=True)
        if args.grade:
            subprocess.run(["ddp-course", "autograde"], cwd=course, capture_output=True)
        rows = []
        for verb in (["status"], ["export", "--out", str(Path(tmp) / "grades.csv")]):
            ours, base = [], []
            for _ in range(args.repeat):  # interleaved: load changes hit both alike
                base.append(timed(BASELINE, verb, course))
                ours.append(timed(OURS, verb, course))
            rows.append((verb[0], statistics.median(base), statistics.median(ours)))
    print(f"class of {args.students}{', graded' if args.grade else ', collected'}; median of {args.repeat} runs")
    print(f"{'verb':<8} {'before (s)':>11} {'now (s)':>8} {'ratio':>6}")
    for verb, base, ours in rows:
        print(f"{verb:<8} {base:>11.2f} {ours:>8.2f} {base / ours:>5.2f}x")


if __name__ == "__main__":
    main()
