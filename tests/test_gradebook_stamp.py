"""A new nbgrader gradebook is stamped with its schema's alembic head found in this process
(course.instructor.gradebook), not by nbgrader's ``alembic heads`` subprocess (about 1.8 s a gradebook)."""

from __future__ import annotations

import sqlite3
import subprocess

import nbgrader.api

import course.instructor.gradebook  # noqa: F401 - what every verb that opens a gradebook imports


def test_the_head_found_here_is_the_one_alembic_prints():
    from nbgrader.dbutil import _temp_alembic_ini

    with _temp_alembic_ini("sqlite:////tmp/gradebook.db") as ini:
        printed = subprocess.check_output(["alembic", "-c", ini, "heads"], timeout=120).decode().split()[0]
    assert nbgrader.api.get_alembic_version() == printed


def test_a_new_gradebook_is_stamped_without_a_process(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "check_output", refuse)
    monkeypatch.setattr(nbgrader.api.sp, "check_output", refuse)
    db = tmp_path / "gradebook.db"
    with nbgrader.api.Gradebook(f"sqlite:///{db}", "course101") as gb:
        gb.add_student("ada")
    with sqlite3.connect(db) as con:
        (stamped,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
    assert stamped == nbgrader.api.get_alembic_version()
