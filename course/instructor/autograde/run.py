"""``ddp-course autograde``: grade every submission on nbgrader, N at a time, and pick up where it stopped.

nbgrader grades one submission at a time, and its SQLite gradebook is unsafe
for parallel writers. Here each submission is graded by nbgrader's own
autograde in a private scratch course with its own gradebook (see
:mod:`course.instructor.gradebook`), on one of N worker processes
(:mod:`course.instructor.autograde.pool`); the parent alone writes the real gradebook,
one finished submission at a time, then moves the autograded notebooks into
``autograded/``.

A submission counts as graded when its autograded notebooks exist, are newer
than the submitted ones (and than its timestamp.txt), and the gradebook holds
its scores: the same test as nbgrader's own, plus the scores. Since the scores
are committed before the notebooks are moved in, a run killed at any moment
loses nothing already graded, and the next run grades only the rest.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import nbformat

from course.errors import CourseError
from course.instructor.autograde.records import (
    Row,
    Submission,
    fill_scores,
    is_graded,
    missing_notebook_reason,
    write_record,
)
from course.instructor.autograde.scratch import install_results, prepare_scratch, scratch_course, scratch_root
from course.instructor.coursedir import Course
from course.instructor.gradebook import make_template

#: what a submission may take beyond the sum of its cells' time limits (kernel start, nbgrader's own work)
STARTUP_MARGIN = 120.0


def default_jobs() -> int:
    """One more than the CPUs (at most 8): a submission leaves cores idle part of the time
    (kernel start-up, ranks waiting for each other); 3 at a time beat 2 on a 2-core machine."""
    return max(1, min(8, (os.cpu_count() or 1) + 1))


def submission_timeout(course: Course, assignment: str) -> float:
    """The most one submission may take: the sum of its cells' limits (Execute.timeout_func), each test
    cell once more for the verifier's re-run when the course verifies (VerifyTests), plus margins."""
    from course.grading.pipeline import VerifyTests
    from course.grading.verifier import STARTUP as VERIFIER_STARTUP

    execute = course.config.Execute
    timeout_func = execute.get("timeout_func")
    default = execute.get("timeout", 30) or 30
    verified = VerifyTests in _autograde_steps(course)
    verify_limit = course.config.VerifyTests.get("cell_timeout", VerifyTests.cell_timeout.default_value)
    total = STARTUP_MARGIN + (VERIFIER_STARTUP if verified else 0.0)
    for path in course.folder("source", assignment=assignment).glob("*.ipynb"):
        for cell in nbformat.read(str(path), as_version=4).cells:
            if cell.cell_type == "code":
                limit = timeout_func(cell) if timeout_func else default
                total += limit if limit and limit > 0 else default
                meta = cell.metadata.get("nbgrader", {})
                if verified and meta.get("grade") and not meta.get("solution"):
                    total += verify_limit
    return total


def _autograde_steps(course: Course) -> list:
    from nbgrader.converters import Autograde

    return list(course.config.Autograde.get("autograde_preprocessors",
                                            Autograde.autograde_preprocessors.default_value))


def isolation_line(course: Course) -> str:
    """One line for the start of a run: how each notebook is isolated (course.sandbox), or that it is not."""
    from course.grading.execute import SandboxedExecute
    from course.sandbox import describe

    if SandboxedExecute in _autograde_steps(course):
        return describe()
    return ("sandbox: none: this course's nbgrader_config.py runs notebooks unsandboxed and unverified "
            "(it predates ddp-course's sandbox; `ddp-course init --force` rewrites it)")


#: failures nbgrader reports with a misleading or cryptic line, and what they mean
_KNOWN_FAILURES = (
    ("Timeout waiting for IOPub output", "a cell ran past its time limit and ignored the interrupt, "
     "so nbgrader gave up on the notebook (see the log for the cell)"),
    ("UnresponsiveKernelError", "the kernel stopped answering (an endless loop that ignores interrupts?)"),
    ("DeadKernelError", "the kernel died (out of memory, or the student's code exited the process)"),
)


def _short_reason(result: dict) -> str:
    """The most telling line of a failed nbgrader run (its last exception line)."""
    text = "\n".join(filter(None, [result.get("log", ""), result.get("error", "")]))
    for marker, meaning in _KNOWN_FAILURES:
        if marker in text:
            return meaning
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and "NbGraderException" not in line and not line.startswith("File "):
            return line[:300]
    return lines[-1][:300] if lines else "nbgrader failed without a message"


# -- the run ---------------------------------------------------------------------------------------------------


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM behaves like Ctrl-C, so a killed run cleans up its workers the same way."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _course_lock(course: Course):
    """One autograde at a time per course (they share the scratch space); released even on SIGKILL."""
    import fcntl

    course.state_dir.mkdir(parents=True, exist_ok=True)
    with open(course.state_dir / "autograde.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise CourseError(
                f"another ddp-course autograde is running in {course.root} (pid {fh.read().strip() or '?'})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


@contextmanager
def _deferred_interrupts():
    """Hold Ctrl-C/SIGTERM until the block ends, so a result is never half installed."""
    caught = []

    def hold(signum, frame):
        caught.append(signum)

    try:
        previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            raise KeyboardInterrupt


def plan(course: Course, assignments: list[str], students: tuple[str, ...], force: bool):
    """(submissions to grade, rows for the submissions that need no work)."""
    todo, rows = [], []
    for assignment, student in course.submitted(assignments):
        if students and student not in students:
            continue
        submission = Submission(assignment, student)
        reason = missing_notebook_reason(course, submission)
        if reason:
            write_record(course, submission, "failed", None, reason)
            rows.append(Row(submission, "failed", reason=reason))
        elif not force and is_graded(course, submission):
            rows.append(Row(submission, "already graded"))
        else:
            todo.append(submission)
    return todo, rows


def check_released(course: Course, todo: list[Submission]) -> None:
    """Stop with what to do when a submission's assignment is not in the gradebook yet."""
    with course.gradebook() as gb:
        released = {a.name for a in gb.assignments}
    unreleased = sorted({j.assignment for j in todo} - released)
    if unreleased:
        raise CourseError(f"not released yet (no gradebook entry): {', '.join(unreleased)}; run ddp-course release")


@dataclass
class AutogradeRun:
    """What a run did: one row per submission, and whether it was interrupted (Ctrl-C, SIGTERM)."""

    rows: list[Row]
    interrupted: bool = False


def run_autograde(
    course: Course,
    assignments: list[str],
    *,
    jobs: int = 1,
    students: tuple[str, ...] = (),
    force: bool = False,
    timeout: float | None = None,
    console=None,
    held_elsewhere=None,
) -> AutogradeRun:
    """Grade every submission of ``assignments`` not graded yet, ``jobs`` at a time.

    ``held_elsewhere(course)``: the submissions a scheduler's run holds, each with why it is not graded here
    (``slurm.elsewhere``, which this module cannot import: slurm.py builds on it); those are left alone."""
    from rich.console import Console

    console = console or Console()
    with _course_lock(course):
        todo, rows = plan(course, assignments, students, force)
        away = held_elsewhere(course) if held_elsewhere else {}
        rows += [Row(s, "not graded", reason=str(away[s])) for s in todo if s in away]
        todo = [s for s in todo if s not in away]
        if not todo:
            return AutogradeRun([fill_scores(course, r) for r in rows])
        check_released(course, todo)
        isolation = isolation_line(course)
        console.print(isolation, highlight=False)
        return _grade(course, todo, rows, jobs=jobs, timeout=timeout, console=console, isolation=isolation)


def _grade(course: Course, todo: list[Submission], rows: list[Row], *, jobs: int, timeout: float | None,
           console, isolation: str = "") -> AutogradeRun:
    """Grade ``todo`` on a worker pool with a progress display; ``rows`` (the work already done) grows."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from course.instructor.autograde.pool import WorkerPool

    scratch_dir = scratch_root(course)
    shutil.rmtree(scratch_dir, ignore_errors=True)  # what an interrupted run left
    scratch_dir.mkdir(parents=True)
    template = scratch_dir / "template.db"
    make_template(course.db_url, course.course_id, sorted({j.assignment for j in todo}), template,
                  [(j.assignment, j.student) for j in todo])
    limits = {a: timeout or submission_timeout(course, a) for a in {j.assignment for j in todo}}

    pending = list(todo)
    pool = WorkerPool(min(jobs, len(todo)), course.root, course.state_dir / "logs" / "workers")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    started: dict[Submission, float] = {}
    slot_of: dict[Submission, int] = {}
    interrupted = False
    try:
        # refreshed from the loop below, not by a thread: the pool forks its workers from this process
        with _sigterm_as_interrupt(), Progress(*columns, console=console, auto_refresh=False) as progress:
            overall = progress.add_task(f"autograde, {pool.size} at a time", total=len(todo))
            slots = [progress.add_task("", total=None, visible=False) for _ in range(pool.size)]

            def refill() -> None:
                for index in pool.idle():
                    if not pending:
                        break
                    submission = pending.pop(0)
                    scratch = prepare_scratch(course, submission, template)
                    pool.submit(index, submission, {"scratch": str(scratch.root), "assignment": submission.assignment,
                                             "student": submission.student}, limits[submission.assignment])
                    started[submission], slot_of[submission] = time.monotonic(), index
                    progress.reset(slots[index], description=f"  {submission}", total=None, visible=True)

            refill()
            while pending or pool.running():
                ended = pool.poll(wait=0.5)
                progress.refresh()
                if not ended:
                    continue
                with _deferred_interrupts():  # a Ctrl-C now waits until the ended jobs are recorded
                    for outcome in ended:
                        progress.update(slots[slot_of.pop(outcome.task)], visible=False)
                    refill()  # a freed worker starts its next submission while this one's results are merged
                    for outcome in ended:
                        row = _finish(course, outcome, isolation=isolation)
                        rows.append(row)
                        progress.advance(overall)
                        score = f" {row.score:g}/{row.max_score:g}" if row.score is not None else ""
                        progress.console.print(
                            f"{row.status:>8}  {row.submission}{score} ({row.elapsed:.0f} s) {row.reason}".rstrip())
    except KeyboardInterrupt:
        interrupted = True
        running = [submission for submission, _ in pool.running()]
        pool.close()
        rows.extend(Row(submission, "interrupted", time.monotonic() - started[submission], "stopped: rerun to grade it")
                    for submission in running)
        rows.extend(Row(submission, "not graded", reason="rerun to grade it") for submission in pending)
    finally:
        pool.close()
        shutil.rmtree(scratch_dir, ignore_errors=True)
    return AutogradeRun([fill_scores(course, r) for r in rows], interrupted)


def _finish(course: Course, outcome, scratch: Course | None = None, isolation: str = "") -> Row:
    """Install or record one ended submission (graded in ``scratch``, default its scratch course, under the
    sandbox ``isolation`` describes); its summary row."""
    submission: Submission = outcome.task
    scratch = scratch or scratch_course(course, submission)
    try:
        if outcome.kind == "done" and outcome.result.get("success"):
            install_results(course, scratch, submission)
            write_record(course, submission, "graded", outcome.elapsed, log=outcome.result.get("log", ""),
                         isolation=isolation)
            return fill_scores(course, Row(submission, "graded", outcome.elapsed))
        if outcome.kind == "done":
            reason = _short_reason(outcome.result)
            log = (outcome.result.get("log") or "") + "\n" + (outcome.result.get("error") or "")
            write_record(course, submission, "failed", outcome.elapsed, reason, log, isolation=isolation)
            return Row(submission, "failed", outcome.elapsed, reason)
        status = "timeout" if outcome.kind == "timeout" else "failed"
        write_record(course, submission, status, outcome.elapsed, outcome.detail, isolation=isolation)
        return Row(submission, status, outcome.elapsed, outcome.detail)
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)
