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
import time
from dataclasses import dataclass

from course.errors import CourseError
from course.instructor.autograde.config import isolation_line, submission_timeout
from course.instructor.autograde.guards import (
    course_lock,
    deferred_interrupts,
    ignored_interrupts,
    sigterm_as_interrupt,
)
from course.instructor.autograde.merge import finish
from course.instructor.autograde.records import (
    Row,
    Submission,
    fill_scores,
    is_graded,
    missing_notebook_reason,
    record_interrupted,
    write_record,
)
from course.instructor.autograde.scratch import prepare_scratch, scratch_root
from course.instructor.coursedir import Course
from course.instructor.gradebook import make_template


def default_jobs() -> int:
    """One more than the CPUs (at most 8): a submission leaves cores idle part of the time
    (kernel start-up, ranks waiting for each other); 3 at a time beat 2 on a 2-core machine."""
    return max(1, min(8, (os.cpu_count() or 1) + 1))


# -- the run ---------------------------------------------------------------------------------------------------


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
    check_sources(course, sorted({j.assignment for j in todo}))


def check_sources(course: Course, assignments: list[str]) -> None:
    """Stop when an assignment's source/ folder holds a file that is not student material: nbgrader's autograde
    copies every file of source/ into each submission's folder, where the student's code runs and could read it."""
    from course.instructor.material import survey

    strays = [f"source/{a}/{r}" for a in assignments for r in survey(course.folder("source", assignment=a)).refused]
    if strays:
        raise CourseError("not graded: autograde would copy these files beside every submission, where the "
                          "student's code could read them:\n  " + "\n  ".join(strays)
                          + "\nremove them from source/ (a file students need is declared in its notebook's "
                          "metadata: docs/writing-exercises.md), then run autograde again")


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
) -> AutogradeRun:
    """Grade every submission of ``assignments`` not graded yet, ``jobs`` at a time; those a Slurm or
    Kubernetes run holds are left to it."""
    from rich.console import Console

    # imported here: `python -m course.instructor.autograde.batch` must find batch not imported yet
    from course.instructor.autograde.batch import set_aside

    console = console or Console()
    with course_lock(course):
        todo, rows = plan(course, assignments, students, force)
        todo = set_aside(course, todo, rows)
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
        with sigterm_as_interrupt(), Progress(*columns, console=console, auto_refresh=False) as progress:
            overall = progress.add_task(f"autograde, {pool.size} at a time", total=len(todo))
            slots = [progress.add_task("", total=None, visible=False) for _ in range(pool.size)]

            def refill() -> None:
                for index in pool.idle():
                    if not pending:
                        break
                    submission = pending.pop(0)
                    started[submission] = time.monotonic()  # from here on a Ctrl-C leaves it "interrupted"
                    scratch = prepare_scratch(course, submission, template)
                    pool.submit(index, submission, {"scratch": str(scratch.root), "assignment": submission.assignment,
                                             "student": submission.student}, limits[submission.assignment])
                    slot_of[submission] = index
                    progress.reset(slots[index], description=f"  {submission}", total=None, visible=True)

            refill()
            while pending or pool.running():
                ended = pool.poll(wait=0.5)
                progress.refresh()
                if not ended:
                    continue
                with deferred_interrupts():  # a Ctrl-C now waits until the ended jobs are recorded
                    for outcome in ended:
                        progress.update(slots[slot_of.pop(outcome.task)], visible=False)
                    refill()  # a freed worker starts its next submission while this one's results are merged
                    for outcome in ended:
                        row = finish(course, outcome, isolation=isolation)
                        rows.append(row)
                        progress.advance(overall)
                        score = f" {row.score:g}/{row.max_score:g}" if row.score is not None else ""
                        progress.console.print(
                            f"{row.status:>8}  {row.submission}{score} ({row.elapsed:.0f} s) {row.reason}".rstrip())
    except KeyboardInterrupt:
        interrupted = True
        with ignored_interrupts():  # stopping already: a second Ctrl-C does not cut the records short
            pool.close()  # every worker's tree killed first: nothing of theirs is installed after this
            merged = {r.submission for r in rows}
            # started and not merged: those running, and any whose outcome the interrupt kept poll from returning
            rows.extend(record_interrupted(course, submission, time.monotonic() - started[submission],
                                           "stopped (Ctrl-C or SIGTERM) before it was graded: rerun to grade it")
                        for submission in started if submission not in merged)
        rows.extend(Row(submission, "not graded", reason="rerun to grade it") for submission in pending)
    finally:
        pool.close()
        shutil.rmtree(scratch_dir, ignore_errors=True)
    return AutogradeRun([fill_scores(course, r) for r in rows], interrupted)
