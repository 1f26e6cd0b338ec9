"""The class server's parts, each on its own (tests/test_hub.py runs them together behind a real hub): the roster,
the progress record (written by a student's kernel, read by root without trusting it), the progress page, the
hub's config, the exchange's rules and the class folder's permissions."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

import course.progress as progress
from course.errors import CheckFailed
from course.hub import service
from course.hub.exchange import FACTORY, submission_problem
from course.hub.hubconfig import Ports, render
from course.hub.layout import ClassDir, sources_exposed
from course.hub.roster import Member, RosterError, read_roster

ROOT = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners (root only)")


# --------------------------------------------------------------------------- roster


def test_a_roster_lists_students_and_instructors(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("# the spring class\nUsername,Role,Name\nada,student,Ada Lovelace\n\ngrace,Instructor,Grace\n")
    assert read_roster(roster) == [Member("ada", "student", "Ada Lovelace"), Member("grace", "instructor", "Grace")]


def test_a_bad_roster_names_every_bad_row(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("username,role\nAda,student\nroot,student\nbob,student\nbob,student\ncy,teacher\ng,instructor\n")
    with pytest.raises(RosterError) as err:
        read_roster(roster)
    text = str(err.value)
    assert "row 1 (Ada)" in text and "lower-case" in text
    assert "row 2 (root)" in text and "system account" in text
    assert "row 4 (bob)" in text and "listed twice (first in row 3)" in text
    assert "row 5 (cy)" in text and "'teacher'" in text
    assert "row 6" not in text and "row 3 " not in text


def test_a_name_that_would_break_the_account_file_is_refused(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text('username,role,name\nada,student,"Ada: the first"\ngrace,instructor,Grace\n')
    with pytest.raises(RosterError, match=r"row 1 \(ada\).*no ':'"):
        read_roster(roster)


@pytest.mark.parametrize("text, words", [
    ("name,role\nada,student\n", "username,role"),
    ("username,role\nada,student\n", "no instructor"),
    ("username,role\n", "lists nobody"),
])
def test_a_roster_without_what_a_class_needs_is_refused(tmp_path, text, words):
    roster = tmp_path / "roster.csv"
    roster.write_text(text)
    with pytest.raises(RosterError, match=words):
        read_roster(roster)


# --------------------------------------------------------------------------- progress, written by the kernel


def _notebook(path: Path, cells) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _code(cell_id: str, grade_id: str | None = None):
    cell = nbformat.v4.new_code_cell("pass")
    cell.id = cell_id
    if grade_id:
        cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "points": 1, "solution": False,
                                     "locked": True, "schema_version": 3}
    return cell


def _ran(cell_id: str, error: BaseException | None = None):
    return SimpleNamespace(info=SimpleNamespace(cell_id=cell_id), error_before_exec=None, error_in_exec=error)


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    workspace = tmp_path / "work"
    record = tmp_path / "home" / ".ddp-course" / "progress.json"
    _notebook(workspace / "lessons" / "01-x.ipynb", [_code("a"), nbformat.v4.new_markdown_cell("m"), _code("b")])
    _notebook(workspace / "ex1" / "nb.ipynb", [_code("answer"), _code("t1", "test_one"), _code("t2", "test_two")])
    monkeypatch.setenv(progress.PROGRESS_ENV, str(record))
    monkeypatch.setenv(progress.WORKSPACE_ENV, str(workspace))
    rec = progress.Recorder(record, workspace)

    def run(notebook: str, cell_id: str, error=None):
        monkeypatch.setenv("JPY_SESSION_NAME", notebook)
        rec.post_run_cell(_ran(cell_id, error))
        return json.loads(record.read_text())["notebooks"] if record.exists() else {}

    return SimpleNamespace(run=run, record=record, workspace=workspace)


def test_a_lesson_is_finished_when_each_of_its_code_cells_ran_without_error(recorder):
    notebooks = recorder.run("lessons/01-x.ipynb", "a")
    assert notebooks["lessons/01-x.ipynb"]["finished"] is False
    notebooks = recorder.run("lessons/01-x.ipynb", "b", error=ValueError("boom"))
    assert notebooks["lessons/01-x.ipynb"]["ran"] == ["a"], "a cell that raised did not run"
    notebooks = recorder.run("lessons/01-x.ipynb", "b")
    assert notebooks["lessons/01-x.ipynb"] | {"updated": ""} == {"ran": ["a", "b"], "cells": 2, "finished": True,
                                                                "updated": ""}


def test_a_test_cell_records_its_last_result_and_the_check_that_failed(recorder, tmp_path):
    failure = CheckFailed("check_shards", "rank 1 got the samples of rank 0", ranks=[1])
    recorder.run(str(recorder.workspace / "ex1" / "nb.ipynb"), "t1", error=failure)  # an absolute session path
    notebooks = recorder.run("ex1/nb.ipynb", "t1", error=failure)
    test = notebooks["ex1/nb.ipynb"]["tests"]["test_one"]
    assert (test["passed"], test["check"], test["tries"], test["failures"]) == (False, "check_shards", 2, 2)
    assert "rank 1 got the samples of rank 0" in test["message"]
    notebooks = recorder.run("ex1/nb.ipynb", "t1")
    test = notebooks["ex1/nb.ipynb"]["tests"]["test_one"]
    assert (test["passed"], test["check"], test["tries"], test["failures"]) == (True, "", 3, 2)
    assert "test_two" not in notebooks["ex1/nb.ipynb"]["tests"], "a test cell that never ran has no result"


def test_nothing_is_recorded_outside_the_workspace_or_a_notebook(recorder, tmp_path):
    outside = _notebook(tmp_path / "elsewhere" / "nb.ipynb", [_code("a")])
    assert recorder.run(str(outside), "a") == {}
    assert recorder.run("console", "a") == {}
    assert recorder.run("lessons/01-x.ipynb", "not-a-cell-of-it") == {}


def test_the_extension_records_nothing_off_the_class_server(monkeypatch):
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    shell = SimpleNamespace(events=SimpleNamespace(register=lambda *a: pytest.fail("registered off the server")))
    progress.load_ipython_extension(shell)


def test_a_hint_asked_is_noted_in_the_progress(recorder):
    from course.grading import hints

    folder = recorder.workspace / "ex1"
    hints.record(folder, check="check_shards", package="graders.ddp_basics", level=2, failure="f", asked_in="check")
    entry = json.loads(recorder.record.read_text())["notebooks"]["ex1/"]
    assert [(h["check"], h["level"]) for h in entry["hints"]] == [("check_shards", 2)]


# --------------------------------------------------------------------------- progress, read by root


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    (home / ".ddp-course").mkdir(parents=True)
    return home


def test_the_record_is_read_when_it_is_the_students_own_file(home):
    (home / ".ddp-course" / "progress.json").write_text('{"notebooks": {}}')
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid()) == b'{"notebooks": {}}'
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid() + 4242) is None, "another's file"


def test_a_record_that_is_a_link_is_not_followed(home, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root's secret")
    (home / ".ddp-course" / "progress.json").symlink_to(secret)
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid()) is None
    (home / ".ddp-course" / "progress.json").unlink()
    (home / ".ddp-course").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "progress.json").write_text("{}")
    (home / ".ddp-course").symlink_to(tmp_path / "elsewhere")
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid()) is None, "a linked folder"


def test_a_record_too_large_or_not_a_file_is_not_read(home):
    (home / ".ddp-course" / "progress.json").write_bytes(b" " * (progress.MAX_BYTES + 1))
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid()) is None
    (home / ".ddp-course" / "progress.json").unlink()
    os.mkfifo(home / ".ddp-course" / "progress.json")
    assert progress.open_private(home, progress.RECORD_PARTS, os.getuid()) is None, "a fifo must not block"


def test_only_fields_of_the_expected_types_are_kept():
    hostile = {"notebooks": {
        "lessons/01.ipynb": {"cells": 3, "ran": ["a", "b"], "finished": "yes", "updated": 7},
        "ex/nb.ipynb": {"tests": {"t": {"passed": "true", "check": "x" * 5000, "tries": "9", "failures": 2},
                                  "u": ["not", "a", "dict"]},
                        "hints": [{"check": "c", "level": 2}, "junk"]},
        "bad": ["not a dict"],
    }}
    cleaned = progress.clean(hostile)
    assert cleaned["lessons/01.ipynb"] == {"updated": "", "cells": 3, "ran": 2, "finished": False}
    test = cleaned["ex/nb.ipynb"]["tests"]["t"]
    assert test["passed"] is False and len(test["check"]) == progress.MAX_TEXT and test["tries"] == 0
    assert list(cleaned["ex/nb.ipynb"]["tests"]) == ["t"] and len(cleaned["ex/nb.ipynb"]["hints"]) == 1
    assert "bad" not in cleaned
    assert progress.clean(["not", "a", "record"]) == {} and progress.clean({"notebooks": 3}) == {}


def test_the_class_view_says_where_a_student_is_stuck():
    record = {
        "lessons/01.ipynb": {"finished": True, "updated": "2026-01-01"},
        "lessons/02.ipynb": {"finished": False, "updated": "2026-01-02"},
        "ex/nb.ipynb": {"updated": "2026-01-03", "hints": [{"check": "c"}] * 2, "tests": {
            "a": {"passed": True, "failures": 9, "check": "", "message": ""},
            "b": {"passed": False, "failures": 4, "check": "check_b", "message": "rank 1 wrong"},
            "c": {"passed": False, "failures": 1, "check": "check_c", "message": ""}}},
    }
    found = progress.summary(record)
    assert found["lessons"] == ["lessons/01.ipynb"] and (found["passing"], found["failing"]) == (1, 2)
    assert found["stuck"] == {"failures": 4, "notebook": "ex/nb.ipynb", "cell": "b", "check": "check_b",
                              "message": "rank 1 wrong"}
    assert (found["hints"], found["last"]) == (2, "2026-01-03")
    assert progress.summary({})["stuck"] is None


def test_the_progress_pages_escape_what_a_student_wrote():
    record = progress.clean({"notebooks": {"<script>x</script>.ipynb": {"tests": {
        "t": {"passed": False, "check": "<img src=x onerror=alert(1)>", "message": "<b>"}}}}})
    page = service.student_html("ada", record, ["lessons/01-a.ipynb"])
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert "lessons/01-a.ipynb: not started" in page
    view = service.class_html({"<i>eve</i>": progress.summary(record)}, lessons=4)
    assert "<i>eve" not in view and "0 of 4" in view


# --------------------------------------------------------------------------- the hub's config


def load_config(text: str):
    """The hub's config file as JupyterHub loads it: run, with ``get_config`` giving one Config."""
    from traitlets.config import Config

    config = Config()
    exec(compile(text, "jupyterhub_config.py", "exec"), {"get_config": lambda: config})  # noqa: S102
    return config


def test_the_hub_config_lets_in_the_roster_only_and_starts_servers_as_their_users(tmp_path):
    members = [Member("ada", "student"), Member("grace", "instructor")]
    config = load_config(render(ClassDir(tmp_path), members, "127.0.0.1", Ports(8000, 8081, 8001, 8002)))
    assert config.Authenticator.allowed_users == {"ada", "grace"}
    assert config.Authenticator.admin_users == {"grace"}
    assert config.JupyterHub.authenticator_class == "pam" and config.JupyterHub.spawner_class == "localprocess"
    assert config.Spawner.cmd[1:] == ["-m", "course.hub.singleuser"]
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8000"
    spawner = SimpleNamespace(environment={}, user=SimpleNamespace(name="grace"))
    config.Spawner.pre_spawn_hook(spawner)
    assert spawner.environment["DDP_COURSE_HUB_ROLE"] == "instructor"
    spawner = SimpleNamespace(environment={}, user=SimpleNamespace(name="ada"))
    config.Spawner.pre_spawn_hook(spawner)
    assert spawner.environment["DDP_COURSE_HUB_ROLE"] == "student"
    assert config.JupyterHub.cookie_secret_file.startswith(str(tmp_path / "hub"))


def test_the_hub_can_stop_idle_servers_and_serve_https(tmp_path):
    members = [Member("ada", "student"), Member("grace", "instructor")]
    plain = load_config(render(ClassDir(tmp_path), members, "127.0.0.1", Ports(8000, 8081, 8001, 8002)))
    assert [s["name"] for s in plain.JupyterHub.services] == ["progress"] and "ssl_cert" not in plain.JupyterHub
    full = load_config(render(ClassDir(tmp_path), members, "0.0.0.0", Ports(443, 8081, 8001, 8002), idle_minutes=30,
                       ssl=("/etc/ssl/hub.pem", "/etc/ssl/hub.key")))
    culler = next(s for s in full.JupyterHub.services if s["name"] == "idle-culler")
    assert culler["command"][1:] == ["-m", "jupyterhub_idle_culler", "--timeout=1800"]
    role = next(r for r in full.JupyterHub.load_roles if r["name"] == "idle-culler")
    assert role["services"] == ["idle-culler"] and "delete:servers" in role["scopes"]
    assert (full.JupyterHub.ssl_cert, full.JupyterHub.ssl_key) == ("/etc/ssl/hub.pem", "/etc/ssl/hub.key")
    assert full.JupyterHub.bind_url == "https://0.0.0.0:443"


def test_each_role_gets_its_own_tools_and_the_class_exchange(tmp_path):
    folder = ClassDir(tmp_path)
    student = folder.nbgrader_config("student")
    instructor = folder.nbgrader_config("instructor")
    for step, cls in FACTORY.items():
        assert f'c.ExchangeFactory.{step} = "course.hub.exchange.{cls.__name__}"' in student
    assert "CourseDirectory.root" not in student and "groupshared = True" in instructor


# --------------------------------------------------------------------------- exchange and folders


@needs_root
def test_a_submission_is_filed_only_under_its_folders_student_and_owner(tmp_path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    own = tmp_path / "nobody+ex1+2026-01-01 00:00:00 UTC+r"
    own.mkdir()
    os.chown(own, nobody.pw_uid, nobody.pw_gid)
    assert submission_problem("nobody", str(own), "nobody") is None
    assert "named for 'ada'" in submission_problem("nobody", str(own), "ada")
    os.chown(own, 0, 0)
    assert "belongs to root, not to nobody" in submission_problem("nobody", str(own), "nobody")
    link = tmp_path / "link"
    link.symlink_to(own)
    assert "not a folder" in submission_problem("nobody", str(link), "nobody")
    assert "no account" in submission_problem("no-such-user-here", str(own), "no-such-user-here")


@needs_root
def test_the_exchange_gives_each_student_a_folder_only_they_and_instructors_enter(tmp_path):
    folder = ClassDir(tmp_path / "class", instructor_group="root")
    folder.make_private_parts()
    folder.make_exchange([Member("nobody", "student")])
    modes = {p.relative_to(folder.root).as_posix(): (stat.S_IMODE(p.stat().st_mode), p.stat().st_uid)
             for p in [folder.hub, *folder.exchange.rglob("*")]}
    import pwd

    assert modes["hub"] == (0o700, 0)
    assert modes["exchange/ddp-course/inbound"] == (0o2751, 0)
    assert modes["exchange/ddp-course/inbound/nobody"] == (0o2770, pwd.getpwnam("nobody").pw_uid)
    assert modes["exchange/ddp-course/outbound"] == (0o2775, 0)
    assert modes["exchange/ddp-course/feedback"] == (0o2771, 0)
    secret = folder.cookie_secret
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text().strip()) == 64
    before = secret.read_text()
    folder.make_private_parts()
    assert secret.read_text() == before, "the cookie secret is made once"


def test_exercise_sources_readable_by_other_users_are_found():
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        source = base / "exercises" / "ex1" / "nb.ipynb"
        source.parent.mkdir(parents=True)
        source.write_text("{}")
        os.chmod(source, 0o644)
        os.chmod(source.parent, 0o755)
        os.chmod(base / "exercises", 0o755)
        assert sources_exposed(base) == [str(source)]
        os.chmod(base / "exercises", 0o750)
        assert sources_exposed(base) == [], "a folder above it closed to others"
        os.chmod(base / "exercises", 0o755)
        os.chmod(source, 0o640)
        assert sources_exposed(base) == []
        assert sources_exposed(base / "none") == []
    finally:
        import shutil

        shutil.rmtree(base)


@needs_root
def test_an_account_lost_with_its_home_kept_is_made_again_as_it_was(tmp_path):
    import pwd
    import secrets
    import subprocess

    from course.hub.roster import _shadow_hash, ensure_accounts

    name, group = f"ddpt{secrets.token_hex(3)}", f"ddptg{secrets.token_hex(3)}"
    passwords, saved = tmp_path / "passwords.csv", tmp_path / "accounts.json"
    try:
        first = ensure_accounts([Member(name, "student")], group, passwords, saved)
        assert first.made == [name] and name in first.passwords
        assert passwords.read_text().splitlines() == ["username,password", f"{name},{first.passwords[name]}"]
        entry, digest = pwd.getpwnam(name), _shadow_hash(name)
        assert stat.S_IMODE(os.stat(entry.pw_dir).st_mode) == 0o700, "a home only its owner enters"
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        subprocess.run(["userdel", name], check=True)  # the machine forgets the account, the home stays
        again = ensure_accounts([Member(name, "student")], group, passwords, saved)
        assert again.restored == [name] and again.passwords == {}
        assert (pwd.getpwnam(name).pw_uid, _shadow_hash(name)) == (entry.pw_uid, digest)
        assert ensure_accounts([Member(name, "instructor")], group, passwords, saved).kept == [name]
        import grp

        assert name in grp.getgrnam(group).gr_mem
    finally:
        subprocess.run(["userdel", "--remove", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def test_a_student_sees_their_progress_in_their_notebook(recorder, monkeypatch, capsys):
    import course

    _notebook(recorder.workspace / "lessons" / "02-y.ipynb", [_code("c")])
    recorder.run("lessons/01-x.ipynb", "a")
    recorder.run("lessons/01-x.ipynb", "b")
    recorder.run("ex1/nb.ipynb", "t1", error=CheckFailed("check_shards", "rank 1 got rank 0's samples", ranks=[1]))
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj.data))
    course.show_progress()
    (page,) = shown
    assert "lessons/01-x.ipynb: <span class=pass>run to the end</span>" in page
    assert "lessons/02-y.ipynb: not started" in page
    assert "test_one <span class=fail>failed</span>: FAILED check_shards [rank 1]: rank 1 got rank 0&#x27;s samples" in page
    monkeypatch.delenv(progress.PROGRESS_ENV)
    course.show_progress()
    assert "class server only" in capsys.readouterr().out
