"""Scratch courses: each submission is graded in a private copy of the course with its own SQLite gradebook.

nbgrader's SQLite gradebook is unsafe for parallel writers, so a worker never
writes the real one: it grades in a scratch course (the course's settings, its own
root, a gradebook copied from a template), and the parent merges the result into
the real gradebook, one submission at a time (:func:`install_results`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from course.instructor.autograde.records import Submission
from course.instructor.coursedir import Course
from course.instructor.gradebook import merge_submission, sqlite_url


def scratch_root(course: Course) -> Path:
    """Where the scratch courses of a run live (removed at the start and the end of every run)."""
    return course.state_dir / "scratch"


def scratch_course(course: Course, submission: Submission, under: Path | None = None) -> Course:
    """The private course a worker grades ``submission`` in (same settings, its own root and SQLite gradebook),
    in ``under`` (default: :func:`scratch_root`; a Slurm run keeps each task's in a folder of its own)."""
    from course.instructor.coursedir import load_config

    root = Path(under or scratch_root(course)) / f"{submission.assignment}--{submission.student}"
    config = load_config(course.root)
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.db_url = sqlite_url(root / "gradebook.db")
    return Course(root, config=config)


def prepare_scratch(course: Course, submission: Submission, template: Path, under: Path | None = None) -> Course:
    scratch = scratch_course(course, submission, under)
    if scratch.root.exists():
        shutil.rmtree(scratch.root)
    scratch.root.mkdir(parents=True)
    scratch.folder("source").parent.mkdir(parents=True, exist_ok=True)
    os.symlink(course.folder("source"), scratch.folder("source"), target_is_directory=True)
    shutil.copytree(course.folder("submitted", submission.student, submission.assignment),
                    scratch.folder("submitted", submission.student, submission.assignment), copy_function=shutil.copy2)
    shutil.copyfile(template, scratch.root / "gradebook.db")
    return scratch


def install_results(course: Course, scratch: Course, submission: Submission) -> None:
    """Write the scores into the real gradebook (one transaction), then move the notebooks into autograded/."""
    merge_submission(scratch.db_url, course.db_url, course.course_id, submission.assignment, submission.student)
    source = scratch.folder("autograded", submission.student, submission.assignment)
    dest = course.folder("autograded", submission.student, submission.assignment)
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(source, dest)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
