"""Wall time to autograde N full submissions: plain ``nbgrader autograde`` vs ``ddp-course autograde --jobs 1/2``.

    python benchmarks/autograde_bench.py [--submissions 8] [--assignment ex1-parallelism] [--jobs 1 2] [--rounds 1]

One course (init, release, N reference submissions filed with collect) is
copied once per contender, so each grades the same submissions from scratch.
Each contender's gradebook is checked (every submission at full marks) before
its time counts. With ``--rounds 2`` or more the contenders run in alternating
order and the median counts. Prints one table with ratios, all measured in this
one run (on a shared machine timings are noisy: compare ratios, note the load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def prepare(root: Path, assignment: str, submissions: int) -> Path:
    """A released course with ``submissions`` reference submissions filed; returns its directory."""
    from course.instructor.collect import collect
    from course.instructor.coursedir import Course
    from course.instructor.init import init_course
    from course.instructor.release import release_assignment
    from course.instructor.samples import write_samples

    course_dir = root / "prepared"
    init_course(course_dir)
    course = Course.open(course_dir)
    release_assignment(course, assignment)
    students = {f"s{i:02d}": "reference" for i in range(1, submissions + 1)}
    write_samples(course, students, [assignment], root / "incoming")
    collect(course, root / "incoming")
    return course_dir


def check(course_dir: Path, assignment: str, submissions: int) -> None:
    """Every submission graded at full marks in this copy's gradebook (or the timing is void)."""
    from course.instructor.coursedir import Course

    with Course.open(course_dir).gradebook() as gb:
        subs = [s for s in gb.assignment_submissions(assignment) if s.score is not None]
        full = [s for s in subs if s.score == s.max_score and s.max_score > 0]
        if len(full) != submissions:
            raise SystemExit(f"{course_dir}: {len(full)}/{submissions} submissions at full marks: timing void")


def timed(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=8)
    parser.add_argument("--assignment", default="ex1-parallelism")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ddp-autograde-bench-") as tmp:
        root = Path(tmp)
        prepared = prepare(root, args.assignment, args.submissions)
        contenders = [("nbgrader autograde", [sys.executable, "-m", "nbgrader", "autograde", args.assignment])]
        contenders += [(f"ddp-course autograde --jobs {j}", ["ddp-course", "autograde", args.assignment, "--jobs", str(j)])
                       for j in args.jobs]
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for round_ in range(args.rounds):
            order = contenders if round_ % 2 == 0 else contenders[::-1]
            for name, argv in order:
                course_dir = root / f"run{len(sum(times.values(), []))}"
                shutil.copytree(prepared, course_dir)
                print(f"round {round_ + 1}: {name} on {args.submissions} submissions of {args.assignment} ...", flush=True)
                seconds = timed(argv, course_dir)
                check(course_dir, args.assignment, args.submissions)
                times[name].append(seconds)
                shutil.rmtree(course_dir)
        load_after = os.getloadavg()
        results = [(name, statistics.median(samples)) for name, samples in times.items()]

    baseline = results[0][1]
    print(f"\n{args.submissions} reference submissions of {args.assignment}, {os.cpu_count()} CPUs, "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"{'contender':<32} {'wall s':>8} {'s/submission':>13} {'speedup vs nbgrader':>20}  samples")
    for name, seconds in results:
        samples = " ".join(f"{t:.0f}" for t in times[name])
        print(f"{name:<32} {seconds:8.1f} {seconds / args.submissions:13.1f} {baseline / seconds:19.2f}x  {samples}")


if __name__ == "__main__":
    main()
