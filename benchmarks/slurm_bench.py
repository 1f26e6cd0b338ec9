"""The same class graded locally (``autograde --jobs 2``) and on Slurm (``autograde --slurm``): wall time,
Slurm's overhead per task, and identical grades.

    python benchmarks/slurm_bench.py [--submissions 16] [--assignment ex1-parallelism] [--cpus-per-task 1] [--per-task 1]

Needs a running Slurm (``docker/ci/install-slurm.sh``) whose node is this machine. One course with N
reference submissions is copied once per contender. For Slurm, each array task's start and end come
from the cluster's jobcomp/filetxt log (``JobCompLoc``); a task's overhead is its run time minus what its
worker spent grading (the records' ``elapsed``), plus its wait from the previous task's end (or from
submission) to its start while a CPU was free.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from autograde_bench import check, prepare  # noqa: E402

JOBCOMP = Path("/var/log/slurm/jobcomp.log")


def grades(course_dir: Path, assignment: str) -> dict[str, tuple]:
    from course.instructor.coursedir import Course

    with Course.open(course_dir).gradebook() as gb:
        return {s.student_id: (s.score, s.max_score) for s in gb.assignment_submissions(assignment)}


def tasks_of(job: str) -> list[dict]:
    """The jobcomp records of array ``job``'s tasks (the fields used here hold no spaces)."""
    found = []
    for line in JOBCOMP.read_text().splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("ArrayJobId") == job:
            found.append(fields)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=16)
    parser.add_argument("--assignment", default="ex1-parallelism")
    parser.add_argument("--cpus-per-task", type=int, default=1)
    parser.add_argument("--per-task", type=int, default=1, help="submissions per array task")
    args = parser.parse_args()
    stamp = lambda s: datetime.datetime.fromisoformat(s).timestamp()  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="ddp-slurm-bench-", dir=os.environ.get("DDP_BENCH_DIR")) as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        prepared = prepare(root, args.assignment, args.submissions)
        results = {}
        for name, argv in (("local --jobs 2", ["ddp-course", "autograde", args.assignment, "--jobs", "2"]),
                           (f"--slurm --cpus-per-task {args.cpus_per_task} --per-task {args.per_task}",
                            ["ddp-course", "autograde", args.assignment, "--slurm", "--cpus-per-task",
                             str(args.cpus_per_task), "--per-task", str(args.per_task)])):
            course_dir = root / name.split()[0].strip("-")
            shutil.copytree(prepared, course_dir)
            started = time.perf_counter()
            proc = subprocess.run(argv, cwd=course_dir, capture_output=True, text=True)
            wall = time.perf_counter() - started
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            check(course_dir, args.assignment, args.submissions)
            records = [json.loads(p.read_text()) for p in
                       (course_dir / ".ddp-course" / "autograde" / args.assignment).glob("*.json")]
            job = re.search(r"submitted Slurm job (\d+)", proc.stdout)
            results[name] = {"wall": wall, "grades": grades(course_dir, args.assignment), "records": records,
                             "job": job.group(1) if job else None}
    local, slurm = results.values()
    same = local["grades"] == slurm["grades"]
    print(f"{args.submissions} reference submissions of {args.assignment}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':<32} {'wall s':>8} {'s/submission':>13}")
    for name, r in results.items():
        print(f"{name:<32} {r['wall']:8.1f} {r['wall'] / args.submissions:13.2f}")
    print(f"grades identical: {same} ({len(local['grades'])} submissions)")
    if slurm["job"] and JOBCOMP.exists():
        tasks = sorted(tasks_of(slurm["job"]), key=lambda t: stamp(t["StartTime"]))
        grading = [float(r.get("elapsed") or 0) for r in slurm["records"]]
        per_task = sum(grading) / len(tasks) if tasks else 0.0  # grading time per task
        runs = [stamp(t["EndTime"]) - stamp(t["StartTime"]) for t in tasks]
        submit = min(stamp(t["SubmitTime"]) for t in tasks)
        first_start = stamp(tasks[0]["StartTime"]) - submit
        print(f"Slurm job {slurm['job']}: {len(tasks)} tasks; first start {first_start:.0f} s after submission; "
              f"task run time median {statistics.median(runs):.1f} s (jobcomp: whole seconds), "
              f"grading per task (records) mean {per_task:.1f} s; "
              f"overhead per task (run time - grading) median {statistics.median(runs) - per_task:.1f} s")


if __name__ == "__main__":
    main()
