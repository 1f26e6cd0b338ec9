"""``ddp-course autograde --slurm`` (issue 17): one job array, merged here, grades exactly as a local run.

The pure parts (the batch script, the split into tasks, what squeue, scontrol and sacct print, the
manifest, the CPUs a course asks for) are tested without Slurm. The rest submits to a real Slurm
(docker/ci/install-slurm.sh makes a one-node cluster here): those tests skip when sinfo is missing or
no node answers, unless DDP_COURSE_REQUIRE_SLURM=1 (CI), where they fail. Every job runs on this
machine's own node; nothing leaves it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import psutil
import pytest
import requirements_gate
import submissions

from course.instructor.autograde.batch import Manifest, largest_world_size, split
from course.instructor.autograde.records import Submission, is_graded, read_record
from course.instructor.autograde.slurm import (
    SlurmOptions,
    TaskState,
    batch_script,
    parse_records,
    parse_sacct,
    parse_squeue,
    slurm_time,
)
from course.instructor.coursedir import Course
from course.instructor.samples import make_sample

# nbgrader's own gradebook code trips SQLAlchemy autoflush warnings (harmless, not ours)
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT, NOTEBOOK = "ex1-parallelism", "parallelism"  # the cheapest exercise
#: a check's job is stopped after this many seconds (the hang's deadlock costs this, not the default 60 s)
ENV = {"DDP_COURSE_CHECK_TIMEOUT": "20"}


# -- no Slurm needed: the pure parts ----------------------------------------------------------------------------


def _manifest(tmp_path: Path, tasks: int = 3) -> Manifest:
    shares = [[{"assignment": ASSIGNMENT, "student": f"s{i}", "timeout": 600.0}] for i in range(tasks)]
    return Manifest(str(tmp_path / "my course"), "20260101-120000-1", shares, cpus_per_task=4)


def test_batch_script_asks_for_one_array(tmp_path):
    manifest = _manifest(tmp_path)
    options = SlurmOptions(partition="gpu", account="cs101", gpus_per_task=1)
    script = batch_script(manifest, time_limit="00:13:00", mem="4096M", options=options,
                          log_dir=tmp_path / "logs", python="/opt/venv/bin/python", job_name="ddp-autograde-cs")
    requests = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert requests == [
        "--job-name=ddp-autograde-cs", "--array=0-2", "--cpus-per-task=4", "--mem=4096M", "--time=00:13:00",
        f'--chdir="{tmp_path}/my course"', f"--output={tmp_path}/logs/task-%a.out",
        "--partition=gpu", "--account=cs101", "--gres=gpu:1",
    ]
    last = script.splitlines()[-1]
    assert last == (f"exec /opt/venv/bin/python -m course.instructor.autograde.batch task "
                    f"'{tmp_path}/my course/.ddp-course/slurm/20260101-120000-1/manifest.json' \"$SLURM_ARRAY_TASK_ID\"")
    plain = batch_script(manifest, time_limit="5", mem="1G", options=SlurmOptions(), log_dir=tmp_path,
                         python="python3", job_name="x")
    assert not re.search(r"--partition|--account|--gres", plain)
    path = tmp_path / "batch.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_tasks_and_time_limits():
    subs = [Submission(ASSIGNMENT, f"s{i}") for i in range(7)]
    assert [len(share) for share in split(subs, 3)] == [3, 3, 1]
    assert split(subs, 1) == [[s] for s in subs]
    assert sum(split(subs, 100), []) == subs
    assert slurm_time(1) == "00:01:00"
    assert slurm_time(61) == "00:02:00"
    assert slurm_time(3600) == "01:00:00"
    assert slurm_time(25 * 3600 + 1) == "1-01:01:00"


def test_manifest_round_trip(tmp_path):
    manifest = _manifest(tmp_path)
    manifest.folder.mkdir(parents=True)
    manifest.job_id, manifest.collected, manifest.waited = "77", [1], {"1": 2.0}
    manifest.save()
    again = Manifest.read(manifest.path)
    assert again == manifest
    assert again.share(2) == [(Submission(ASSIGNMENT, "s2"), 600.0)]
    assert again.label(2) == "77_2" and not again.done
    again.collected = [0, 1, 2]
    assert again.done


def test_squeue_output():
    text = "12_0|RUNNING|None\n12_1|PENDING|Resources\n12_[3-5,7%2]|PENDING|JobArrayTaskLimit\n13_0|RUNNING|None\n"
    live = parse_squeue(text, "12")
    assert sorted(live) == [0, 1, 3, 4, 5, 7]
    assert (live[0].state, live[1].state, live[1].reason) == ("RUNNING", "PENDING", "Resources")
    assert all(t.live for t in live.values())
    assert parse_squeue("", "12") == {}


#: what `scontrol -o show job 3` printed here (Slurm 22.05) for an array of 4 with tasks 0 and 3 ended, one
#: pending meta-record, and what jobcomp/filetxt logged for a task (fields trimmed)
SCONTROL = """\
JobId=3 ArrayJobId=3 ArrayTaskId=3 JobName=t.sh UserId=root(0) JobState=COMPLETED Reason=None ExitCode=0:0 \
SubmitTime=2026-12-01T16:34:11 StartTime=2026-12-01T16:34:19 EndTime=2026-12-01T16:34:28 Command=/tmp/my job.sh
JobId=5 ArrayJobId=3 ArrayTaskId=1 JobName=t.sh JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 \
SubmitTime=2026-12-01T16:34:11 StartTime=2026-12-01T16:34:13 EndTime=2026-12-01T16:34:16
JobId=6 ArrayJobId=3 ArrayTaskId=2 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 \
SubmitTime=2026-12-01T16:34:11 StartTime=2026-12-01T16:34:16 EndTime=2026-12-01T16:35:16
JobId=8 ArrayJobId=3 ArrayTaskId=4-9 JobState=PENDING Reason=Resources SubmitTime=2026-12-01T16:34:11 StartTime=Unknown
JobId=9 ArrayJobId=8 ArrayTaskId=0 JobState=COMPLETED
"""
JOBCOMP = ("JobId=4 UserId=root(0) GroupId=root(0) Name=t.sh JobState=CANCELLED Partition=debug TimeLimit=1 "
           "StartTime=2026-12-01T16:34:13 EndTime=2026-12-01T16:34:15 NodeList=vm SubmitTime=2026-12-01T16:34:11 "
           "ArrayJobId=3 ArrayTaskId=0 DerivedExitCode=0:0 ExitCode=0:15\n")


def test_scontrol_and_jobcomp_records():
    found = parse_records(SCONTROL, "3")
    assert sorted(found) == [1, 2, 3]  # the pending range is squeue's business, job 8 is another array
    assert (found[3].state, found[3].waited) == ("COMPLETED", 8.0)
    assert found[1].describe() == "FAILED (exit code 3:0)"
    assert found[2].describe() == "TIMEOUT (TimeLimit)" and not found[2].live
    assert found[2].ended == datetime(2026, 12, 1, 16, 35, 16)
    comp = parse_records(JOBCOMP, "3")
    assert list(comp) == [0] and comp[0].state == "CANCELLED" and comp[0].waited == 2.0


def test_sacct_records():
    text = ("3_0|CANCELLED by 0|0:15|2026-12-01T16:34:11|2026-12-01T16:34:13|2026-12-01T16:34:15\n"
            "3_0.batch|CANCELLED|0:15|2026-12-01T16:34:11|2026-12-01T16:34:13|2026-12-01T16:34:15\n"
            "3_1|OUT_OF_MEMORY|0:125|2026-12-01T16:34:11|2026-12-01T16:34:12|2026-12-01T16:34:40\n"
            "3_[2-3]|PENDING|0:0|2026-12-01T16:34:11|Unknown|Unknown\n")
    found = parse_sacct(text, "3")
    assert sorted(found) == [0, 1, 2, 3]
    assert found[0].state == "CANCELLED" and found[0].waited == 2.0
    assert found[1].state == "OUT_OF_MEMORY"
    assert found[2].started is None and found[3].live
    assert parse_sacct("Slurm accounting storage is disabled\n", "3") == {}
    assert TaskState(0, "NODE_FAIL").describe() == "NODE_FAIL"


def test_cpus_come_from_the_largest_world_size_a_check_asks_for(tmp_path):
    source = tmp_path / "source" / "a1"
    source.mkdir(parents=True)
    (tmp_path / "nbgrader_config.py").write_text("c = get_config()\n")

    def test_cell(text):
        return nbformat.v4.new_code_cell(text, metadata={"nbgrader": {"grade": True, "grade_id": "t", "points": 1}})

    cells = [
        test_cell("graders.parallelism.check_shards(f)\n### BEGIN HIDDEN TESTS\n"
                  "graders.parallelism.check_shards(f, world_sizes=(4, 3))\n### END HIDDEN TESTS"),
        test_cell("graders.ddp_in_practice.check_hardest(hardest, world_size=5, n=14)"),
        nbformat.v4.new_code_cell("graders.parallelism.check_shards(f, world_size=64)"),  # not a test cell
        test_cell("%%time\nworld_size = 99"),  # not made of check calls
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), source / "nb.ipynb")
    course = Course(tmp_path)
    assert largest_world_size(course, ["a1"]) == 5
    nbformat.write(nbformat.v4.new_notebook(cells=cells[:1]), source / "nb.ipynb")
    assert largest_world_size(course, ["a1"]) == 4
    nbformat.write(nbformat.v4.new_notebook(cells=cells[2:]), source / "nb.ipynb")
    assert largest_world_size(course, ["a1"]) is None


def test_the_real_exercise_asks_for_its_hidden_tests_world_size():
    course = Course(ROOT)  # not a course folder, but source/ is read through the config: point it at exercises/
    course.coursedir.source_directory = "exercises"
    assert largest_world_size(course, []) is None
    assert largest_world_size(course, [ASSIGNMENT]) == 5  # check_shard_sizes(..., world_sizes=(5,))


# -- with Slurm ---------------------------------------------------------------------------------------------------


def _slurm_problem() -> str | None:
    missing = [t for t in ("sinfo", "sbatch", "squeue", "scontrol", "scancel") if shutil.which(t) is None]
    if missing:
        return f"no Slurm here ({', '.join(missing)} not on PATH; docker/ci/install-slurm.sh makes a one-node cluster)"
    proc = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"Slurm's controller does not answer: {proc.stderr.strip()} (docker/ci/install-slurm.sh starts it)"
    if not {"idle", "mixed", "allocated", "completing"} & set(proc.stdout.split()):
        return f"no Slurm node is up (sinfo says: {proc.stdout.split() or 'no node'})"
    return None


@pytest.fixture
def slurm():
    """A Slurm cluster that runs jobs; skip (or fail where DDP_COURSE_REQUIRE_SLURM=1) without one."""
    problem = _slurm_problem()
    if problem:
        requirements_gate.unavailable(problem, "DDP_COURSE_REQUIRE_SLURM")


def cli(*args: str, cwd: Path, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ddp-course", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV, "COLUMNS": "200"})
    if check:
        assert proc.returncode == 0, f"ddp-course {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


#: tries to read the course's solutions, hidden tests, other students' submissions and the gradebook from inside
#: the sandbox; it walks up from its working folder, so the notebook is the same in every course
HOSTILE_READ = """\
import glob, os
found, here = [], os.getcwd()
while here != "/":
    here = os.path.dirname(here)
    for pattern in ("gradebook.db", "source/*/*.ipynb", "submitted/*/*/*.ipynb", "autograded/*/*/*.ipynb",
                    ".ddp-course/slurm/*/manifest.json"):
        found += glob.glob(os.path.join(here, pattern))
read = 0
for path in found:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        read += bool(data)
    except OSError:
        pass
print("hostile cell read", read, "files")
"""
#: tries to write the real gradebook and the Slurm run's manifests and outcomes from inside the sandbox
HOSTILE = HOSTILE_READ + """\
targets, here = [], os.getcwd()
while here != "/":
    here = os.path.dirname(here)
    for pattern in ("gradebook.db", ".ddp-course/slurm/*/manifest.json", ".ddp-course/slurm/*/task-*/*.json"):
        targets += glob.glob(os.path.join(here, pattern))
wrote = 0
for path in targets:
    try:
        with open(path, "ab") as fh:
            fh.write(b"pwned")
        wrote += 1
    except OSError:
        pass
print("hostile cell wrote", wrote, "files")
"""


def make_class(course_dir: Path, incoming: Path, kinds: dict[str, str]) -> None:
    """Write one submission per student (``make_sample`` kinds, plus "hostile": the reference and HOSTILE, and
    "slow": the reference with a last cell that sleeps 15 s, so that its task is surely caught grading;
    "slower": three more cells of 50 s each)."""
    source, release = (course_dir / kind / ASSIGNMENT / f"{NOTEBOOK}.ipynb" for kind in ("source", "release"))
    incoming.mkdir(parents=True, exist_ok=True)
    for student, kind in kinds.items():
        nb, _ = make_sample("reference" if kind in ("hostile", "slow", "slower") else kind, source, release)
        if kind == "hostile":
            nb.cells.append(nbformat.v4.new_code_cell(HOSTILE))
        if kind == "slow":
            nb.cells.append(nbformat.v4.new_code_cell("import time\ntime.sleep(15)"))
        if kind == "slower":  # longer than any 1-minute task limit, each cell within its own time limit
            nb.cells += [nbformat.v4.new_code_cell("import time\ntime.sleep(50)") for _ in range(3)]
        nbformat.write(nb, incoming / f"{student}_{NOTEBOOK}.ipynb")


def class_of(tmp_path: Path, kinds: dict[str, str]) -> Path:
    """A released template course under ``tmp_path`` and its submissions (``make_class``): their folder."""
    template = tmp_path / "template"
    cli("init", str(template), cwd=tmp_path)
    cli("release", ASSIGNMENT, cwd=template)
    incoming = tmp_path / "incoming"
    make_class(template, incoming, kinds)
    return incoming


def assert_left_ungraded(course_dir: Path, student: str, state: str) -> None:
    """``student``'s task ended in ``state``: no scores, no autograded notebook, the state in its record."""
    course = Course.open(course_dir)
    submission = Submission(ASSIGNMENT, student)
    assert not is_graded(course, submission)
    assert not (course_dir / "autograded" / student).exists()
    assert not any(k[0] == student for k in graded(course_dir))
    assert state in read_record(course, submission)["reason"]


def new_course(path: Path, incoming: Path) -> Path:
    cli("init", str(path), cwd=path.parent)
    cli("release", ASSIGNMENT, cwd=path)
    cli("collect", str(incoming), cwd=path)
    return path


def graded(course_dir: Path) -> dict:
    """What grading left: every grade and comment in the gradebook, and each test cell's outputs in the
    autograded notebook (the messages feedback shows), by student."""
    from nbgrader.api import Gradebook, MissingEntry

    from course.instructor.leaks import plain_text

    course = Course.open(course_dir)
    found = {}
    with Gradebook(course.db_url, course.course_id) as gb:
        for student in [s.id for s in gb.students]:
            try:
                submission = gb.find_submission(ASSIGNMENT, student)
            except MissingEntry:
                continue
            for nb in submission.notebooks:
                if nb.name != NOTEBOOK:  # the class hands in this notebook of the assignment only
                    continue
                for grade in nb.grades:
                    found[(student, grade.name, "grade")] = (grade.auto_score, grade.max_score, grade.needs_manual_grade)
                for comment in nb.comments:
                    found[(student, comment.name, "comment")] = comment.auto_comment
    for path in sorted((course_dir / "autograded").glob(f"*/{ASSIGNMENT}/{NOTEBOOK}.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if cell.metadata.get("nbgrader", {}).get("grade"):
                text = "\n".join(o.get("text", "") or o.get("evalue", "") or str(o.get("data", {}).get("text/plain", ""))
                                 for o in cell.get("outputs", []))
                # a stack dump names the kernel's cell files, /tmp/ipykernel_<its pid>/...: no two runs share a pid
                found[(path.parent.parent.name, grade_id, "message")] = re.sub(r"ipykernel_\d+", "ipykernel_PID",
                                                                               plain_text(text))
    return found


def scores(found: dict) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (student, _, kind), value in found.items():
        if kind == "grade":
            totals[student] = totals.get(student, 0.0) + (value[0] or 0.0)
    return totals


def timed(*args: str, cwd: Path, timeout: float = 900, returncode: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = cli(*args, cwd=cwd, timeout=timeout, check=False)
    assert proc.returncode == returncode, f"ddp-course {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, time.monotonic() - start


def task_processes(course_dir: Path) -> list[psutil.Process]:
    """Live processes (not zombies) of any array task or its sandboxes in this course: named in their command
    line, or working in it (a kernel or verifier forked from a zygote has the zygote's command line)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "cwd"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and (
                    str(course_dir) in " ".join(p.info["cmdline"] or [])
                    or Path(p.info["cwd"] or "/").is_relative_to(course_dir)):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


#: five kinds of submission (each graded twice: locally and on Slurm): full marks, partial, none, a deadlock and a
#: hostile cell (the wrong answers of every exercise are graded in tests/test_graders_*)
CLASS = {"ada": "reference", "bob": "partial", "cy": "untouched", "dee": "hang", "fay": "hostile"}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_slurm_grades_a_class_exactly_as_local_jobs(tmp_path, slurm):
    """Five kinds of submission of exercise 1, graded by `autograde --jobs 2` and by `autograde --slurm`:
    the same grades, comments and messages."""
    incoming = class_of(tmp_path, CLASS)
    local = new_course(tmp_path / "local", incoming)
    on_slurm = new_course(tmp_path / "slurm", incoming)

    ran_local, local_s = timed("autograde", "--jobs", "2", cwd=local)
    # the same share of the cores per submission as --jobs 2 here (two tasks side by side on a node of this size)
    cpus = str(max(1, (os.cpu_count() or 2) // 2))
    ran_slurm, slurm_s = timed("autograde", "--slurm", "--cpus-per-task", cpus, cwd=on_slurm)
    print(f"\nclass of {len(CLASS)}: autograde --jobs 2 {local_s:.0f} s, --slurm {slurm_s:.0f} s")
    waits = re.search(r"Slurm: .*", ran_slurm.stdout)
    print(waits.group(0) if waits else ran_slurm.stdout)

    submitted = re.search(r"submitted Slurm job (\d+): (\d+) array tasks", ran_slurm.stdout)
    assert submitted and int(submitted.group(2)) == len(CLASS), ran_slurm.stdout
    assert ran_slurm.stdout.count(" graded ") >= len(CLASS), ran_slurm.stdout
    assert not re.search(r"│\s*(failed|timeout|not graded)\s*│", ran_slurm.stdout), ran_slurm.stdout
    assert not list((on_slurm / ".ddp-course" / "slurm").glob("*")), "a collected run leaves no scratch behind"

    here, there = graded(local), graded(on_slurm)
    kinds = [kind for _, _, kind in here]
    test_cells = len(submissions.full_marks(ASSIGNMENT, NOTEBOOK))
    assert kinds.count("grade") == kinds.count("message") == test_cells * len(CLASS)
    assert there == here
    total = scores(here)
    top = sum(submissions.full_marks(ASSIGNMENT, NOTEBOOK).values())
    assert total["ada"] == total["fay"] == top, total
    assert total["cy"] == 0 and 0 < total["bob"] < top and total["dee"] < top, total
    assert any("FAILED" in v for (s, _, kind), v in there.items() if s == "dee" and kind == "message")
    for folder in (local, on_slurm):  # the sandbox hid the course from it, on Slurm too: nothing read, nothing written
        fay = nbformat.writes(nbformat.read(folder / "autograded" / "fay" / ASSIGNMENT / f"{NOTEBOOK}.ipynb",
                                            as_version=4))
        assert "hostile cell read 0 files" in fay and "hostile cell wrote 0 files" in fay, (folder, fay[-3000:])
        assert b"pwned" not in (folder / "gradebook.db").read_bytes()
    # the control: unsandboxed, from a submission's folder, the same cell reads the solutions, the hidden tests,
    # the other students' work and the gradebook
    shown = subprocess.run([sys.executable, "-c", HOSTILE_READ], capture_output=True, text=True, timeout=60,
                           cwd=on_slurm / "autograded" / "fay" / ASSIGNMENT, check=True).stdout
    assert int(shown.split("read ")[1].split()[0]) >= 1 + 1 + len(CLASS), shown
    for student in CLASS:  # each submission's record says how the machine that graded it isolated it
        for folder in (local, on_slurm):
            record = read_record(Course.open(folder), Submission(ASSIGNMENT, student))
            assert (record.get("isolation") or "").startswith("sandbox: "), (folder, student, record)

    status = cli("status", cwd=on_slurm).stdout
    n = len(CLASS)
    assert re.search(rf"{ASSIGNMENT}\s*│\s*yes\s*│\s*{n}\s*│\s*{n}\s*│\s*0\s*│\s*0\s*│", status), status
    again = cli("autograde", "--slurm", cwd=on_slurm).stdout
    assert again.count("already graded") == n and "submitted" not in again, again


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cancelled_task_leaves_its_students_ungraded_and_a_rerun_grades_them(tmp_path, slurm):
    course_dir = new_course(tmp_path / "course", class_of(tmp_path, {"ada": "slow", "bob": "partial", "cy": "untouched"}))

    submitted = cli("autograde", "--slurm", "--no-wait", "--cpus-per-task", "1", cwd=course_dir).stdout
    job = re.search(r"submitted Slurm job (\d+): 3 array tasks", submitted)
    assert job, submitted
    job_id = job.group(1)
    assert re.search(r"ada\s.*on Slurm \(task \d+_0\)", submitted), submitted  # tasks in plan order: ada first
    assert "on Slurm" in cli("status", cwd=course_dir).stdout

    # cancel ada's task while nbgrader is grading it: its autograded notebook is being written in the scratch course
    grading = course_dir / ".ddp-course" / "slurm"
    deadline = time.monotonic() + 300
    while not list(grading.glob(f"*/task-0/{ASSIGNMENT}--ada/autograded/ada/{ASSIGNMENT}")):
        assert time.monotonic() < deadline, "task 0 never started grading"
        time.sleep(0.2)
    time.sleep(2)
    state = subprocess.run(["squeue", "--noheader", f"--jobs={job_id}_0", "--format=%T"],
                           capture_output=True, text=True).stdout.strip()
    assert state == "RUNNING", f"task 0 is {state!r}: it should be grading ada"
    subprocess.run(["scancel", f"{job_id}_0"], check=True)

    outputs = []
    deadline = time.monotonic() + 400
    while True:
        assert time.monotonic() < deadline, "\n".join(outputs)
        collected = cli("autograde", "--collect", cwd=course_dir, check=False)
        assert collected.returncode in (0, 2), collected.stderr  # 2: done in part (ada's task was cancelled)
        outputs.append(collected.stdout)
        if "on Slurm" not in outputs[-1]:
            break
        time.sleep(3)
    said = "\n".join(outputs)
    assert re.search(rf"ada\s.*failed.*Slurm task {job_id}_0 ended\s+CANCELLED", said, flags=re.S), said
    assert re.search(r"bob\s.*graded", said) and re.search(r"cy\s.*graded", said), said
    assert not task_processes(course_dir), "processes of the cancelled task outlived it"

    # ada stays ungraded: no scores, no autograded notebook, nothing half-written; status says why
    assert_left_ungraded(course_dir, "ada", "CANCELLED")
    status = cli("status", cwd=course_dir).stdout
    assert re.search(r"ada\s*│\s*failed\s*│.*CANCELLED", status), status
    before = {p.parent.parent.name: p.stat().st_mtime for p in (course_dir / "autograded").glob(f"*/{ASSIGNMENT}/*.ipynb")}

    rerun = cli("autograde", "--slurm", "--cpus-per-task", "1", cwd=course_dir).stdout
    assert re.search(r"submitted Slurm job \d+: 1 array tasks", rerun), rerun  # ada alone
    assert rerun.count("already graded") == 2, rerun
    top = sum(submissions.full_marks(ASSIGNMENT, NOTEBOOK).values())  # ada hands in this notebook only
    whole = sum(sum(submissions.full_marks(ASSIGNMENT, nb).values()) for nb in submissions.notebooks(ASSIGNMENT))
    assert re.search(rf"ada\s.*{top:g} / {whole:g}\s.*graded", rerun), rerun
    after = {p.parent.parent.name: p.stat().st_mtime for p in (course_dir / "autograded").glob(f"*/{ASSIGNMENT}/*.ipynb")}
    assert {k: after[k] for k in before} == before and set(after) == {"ada", "bob", "cy"}
    assert is_graded(Course.open(course_dir), Submission(ASSIGNMENT, "ada"))


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_task_past_its_time_limit_leaves_its_students_ungraded(tmp_path, slurm):
    """Slurm ends a task at its --time: the student it held is reported TIMEOUT and stays ungraded."""
    course_dir = new_course(tmp_path / "course", class_of(tmp_path, {"dee": "slower"}))  # 150 s of sleeping cells

    ran, seconds = timed("autograde", "--slurm", "--time", "1", "--cpus-per-task", "1", cwd=course_dir, returncode=2)
    print(f"\na 1-minute task limit ended the task after {seconds:.0f} s")
    said = ran.stdout
    assert re.search(r"dee\s.*failed.*Slurm task \d+_0 ended\s+TIMEOUT", said, flags=re.S), said
    assert not task_processes(course_dir), "processes of the timed-out task outlived it"
    assert_left_ungraded(course_dir, "dee", "TIMEOUT")
