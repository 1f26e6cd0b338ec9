"""What a student ran and passed, recorded as they work: the lessons they ran to the end, the last result of
each visible check, the hints they asked for.

**Recording** happens in the student's own processes, on the class server only (their server sets
``DDP_COURSE_PROGRESS``, :mod:`course.hub.singleuser`): every kernel loads this module as an IPython extension
(:func:`load_ipython_extension`) whose ``post_run_cell`` hook notes, for the notebook it runs, each code cell
that ran without error and, for a test cell (nbgrader's ``grade`` cells), whether its checks passed and which
one failed; asking for a hint (:mod:`course.grading.hints`) notes it too (:func:`note_hint`). The record is a
JSON file in the student's home, replaced whole at each change.

It is the student's own account of their work, for them and for whoever helps them (who is stuck where): it is
never computed from hidden tests and never read by grading; a student who edits it misleads only that view.
So **reading** it (:func:`read_record`, run by the hub's progress service as root) trusts nothing in it: the
file is opened without following a link at any step below the student's home, must belong to the student,
stays under a size limit, and only fields of the expected types are kept.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

#: the record's file, set in the student's server's environment (and so in every kernel it starts)
PROGRESS_ENV = "DDP_COURSE_PROGRESS"
#: the student's workspace (notebook paths in the record are relative to it)
WORKSPACE_ENV = "DDP_COURSE_WORKSPACE"
#: where the record lives, under the student's home
RECORD_PARTS = (".ddp-course", "progress.json")
MAX_BYTES = 1 << 20
MAX_TEXT = 300


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- recording (the student's kernel)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": 1, "notebooks": {}}
    if not isinstance(data, dict) or not isinstance(data.get("notebooks"), dict):
        return {"version": 1, "notebooks": {}}
    return data


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".progress.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=1)
    os.replace(tmp, path)


def update(path: Path, notebook: str, change) -> None:
    """Apply ``change(entry)`` to ``notebook``'s entry of the record at ``path`` and save it; a record that
    cannot be written is skipped (progress must never break a student's cell)."""
    try:
        data = _load(path)
        entry = data["notebooks"].setdefault(notebook, {})
        change(entry)
        entry["updated"] = now()
        _save(path, data)
    except OSError:
        pass


def _code_cells(notebook_path: Path, cache: dict) -> tuple[list[str], dict[str, str]]:
    """(ids of the code cells of the notebook on disk, {cell id: grade id} of its test cells), cached by mtime."""
    try:
        mtime = notebook_path.stat().st_mtime_ns
    except OSError:
        return [], {}
    hit = cache.get(notebook_path)
    if hit and hit[0] == mtime:
        return hit[1], hit[2]
    try:
        cells = json.loads(notebook_path.read_text()).get("cells", [])
    except (OSError, ValueError):
        return [], {}
    code = [c.get("id", "") for c in cells if c.get("cell_type") == "code"]
    tests = {c.get("id", ""): (c.get("metadata", {}).get("nbgrader", {}).get("grade_id") or c.get("id", ""))
             for c in cells if c.get("cell_type") == "code" and c.get("metadata", {}).get("nbgrader", {}).get("grade")}
    cache[notebook_path] = (mtime, code, tests)
    return code, tests


class Recorder:
    """The ``post_run_cell`` hook of a student's kernel."""

    def __init__(self, record: Path, workspace: Path):
        self.record = Path(record)
        self.workspace = Path(workspace)
        self._cache: dict = {}

    def notebook(self) -> tuple[str, Path] | None:
        """(the running notebook's path relative to the workspace, its file), from jupyter_server's
        ``JPY_SESSION_NAME``; None outside a notebook or outside the workspace."""
        name = os.environ.get("JPY_SESSION_NAME", "")
        if not name.endswith(".ipynb"):
            return None
        path = Path(name) if os.path.isabs(name) else self.workspace / name
        try:
            rel = path.resolve().relative_to(self.workspace.resolve())
        except (ValueError, OSError):
            return None
        return rel.as_posix(), path

    def post_run_cell(self, result) -> None:
        info = getattr(result, "info", None)
        cell_id = getattr(info, "cell_id", None)
        found = self.notebook()
        if not cell_id or found is None:
            return
        rel, path = found
        code, tests = _code_cells(path, self._cache)
        if cell_id not in code:
            return
        error = result.error_before_exec or result.error_in_exec
        if cell_id in tests:
            self._note_check(rel, tests[cell_id], error)
        elif error is None:
            def ran(entry):
                done = [c for c in entry.get("ran", []) if c in code]
                entry["ran"] = done + ([cell_id] if cell_id not in done else [])
                entry["cells"] = len(code)
                entry["finished"] = set(entry["ran"]) >= set(code) - set(tests)
            update(self.record, rel, ran)

    def _note_check(self, rel: str, grade_id: str, error: BaseException | None) -> None:
        check = getattr(error, "check", "") if error is not None else ""
        message = "" if error is None else (str(error).strip().splitlines() or [type(error).__name__])[0]

        def checked(entry):
            tests = entry.setdefault("tests", {})
            before = tests.get(grade_id, {})
            tests[grade_id] = {"passed": error is None, "check": str(check)[:MAX_TEXT],
                               "message": message[:MAX_TEXT], "at": now(),
                               "tries": int(before.get("tries", 0)) + 1,
                               "failures": int(before.get("failures", 0)) + (error is not None)}
        update(self.record, rel, checked)


def load_ipython_extension(shell) -> None:
    """Record this kernel's progress (``%load_ext course.progress``; the class server loads it in every
    kernel). Does nothing where :data:`PROGRESS_ENV` is not set."""
    record, workspace = os.environ.get(PROGRESS_ENV), os.environ.get(WORKSPACE_ENV)
    if not record or not workspace:
        return
    shell.events.register("post_run_cell", Recorder(Path(record), Path(workspace)).post_run_cell)


def note_hint(notebook_folder: Path, check: str, level: int) -> None:
    """Note that a hint was given (called by :func:`course.grading.hints.record`); nothing off the server."""
    record, workspace = os.environ.get(PROGRESS_ENV), os.environ.get(WORKSPACE_ENV)
    if not record or not workspace:
        return
    try:
        rel = Path(notebook_folder).resolve().relative_to(Path(workspace).resolve()).as_posix()
    except (ValueError, OSError):
        return

    def asked(entry):
        hints = entry.setdefault("hints", [])
        hints.append({"check": str(check)[:MAX_TEXT], "level": int(level), "at": now()})
        del hints[:-50]
    update(Path(record), f"{rel}/", asked)


# --------------------------------------------------------------------------- reading (the hub, as root)


def open_private(home: Path, parts: tuple[str, ...], uid: int) -> bytes | None:
    """The bytes of ``home/parts...``, reached without following a link below ``home``, when it is a regular
    file of ``uid`` no larger than :data:`MAX_BYTES`; None otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fds = []
    try:
        fd = os.open(home, flags | os.O_DIRECTORY)
        fds.append(fd)
        for part in parts[:-1]:
            fd = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            fds.append(fd)
        fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size > MAX_BYTES:
            return None
        return os.read(fd, MAX_BYTES + 1)[:MAX_BYTES]
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _text(value: Any) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def clean(data: Any) -> dict[str, dict[str, Any]]:
    """Only what the progress page shows, each field of its type: {notebook: entry}."""
    notebooks = data.get("notebooks") if isinstance(data, dict) else None
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(notebooks, dict):
        return out
    for name, entry in list(notebooks.items())[:200]:
        if not isinstance(name, str) or not isinstance(entry, dict):
            continue
        kept: dict[str, Any] = {"updated": _text(entry.get("updated"))}
        if isinstance(entry.get("cells"), int):
            kept["cells"] = entry["cells"]
            ran = entry.get("ran")
            kept["ran"] = len(ran) if isinstance(ran, list) else 0
            kept["finished"] = entry.get("finished") is True
        tests = entry.get("tests")
        if isinstance(tests, dict):
            kept["tests"] = {
                _text(grade_id): {"passed": t.get("passed") is True, "check": _text(t.get("check")),
                                  "message": _text(t.get("message")), "at": _text(t.get("at")),
                                  "tries": t.get("tries") if isinstance(t.get("tries"), int) else 0,
                                  "failures": t.get("failures") if isinstance(t.get("failures"), int) else 0}
                for grade_id, t in list(tests.items())[:100] if isinstance(t, dict)}
        hints = entry.get("hints")
        if isinstance(hints, list):
            kept["hints"] = [{"check": _text(h.get("check")), "at": _text(h.get("at")),
                              "level": h.get("level") if isinstance(h.get("level"), int) else 0}
                             for h in hints[:50] if isinstance(h, dict)]
        out[name[:MAX_TEXT]] = kept
    return out


def read_record(username: str) -> dict[str, dict[str, Any]]:
    """The cleaned progress record of the Linux user ``username`` ({} when there is none or it is unusable)."""
    import pwd

    try:
        entry = pwd.getpwnam(username)
    except KeyError:
        return {}
    raw = open_private(Path(entry.pw_dir), RECORD_PARTS, entry.pw_uid)
    if raw is None:
        return {}
    try:
        return clean(json.loads(raw))
    except ValueError:
        return {}


def summary(record: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts for the class view: lessons run to the end, test cells passing, failing, hints asked, where stuck
    (the test cell failed most often without passing since), last activity."""
    lessons = sorted(n for n, e in record.items() if e.get("finished") and n.startswith("lessons/"))
    passing, failing, stuck, hints, last = [], [], None, 0, ""
    for notebook, entry in record.items():
        last = max(last, entry.get("updated", ""))
        hints += len(entry.get("hints", []))
        for grade_id, test in entry.get("tests", {}).items():
            (passing if test["passed"] else failing).append(f"{notebook}:{grade_id}")
            if not test["passed"] and (stuck is None or test["failures"] > stuck[0]):
                stuck = (test["failures"], notebook, grade_id, test["check"], test["message"])
    return {"lessons": lessons, "passing": len(passing), "failing": len(failing), "hints": hints,
            "stuck": None if stuck is None else {"failures": stuck[0], "notebook": stuck[1], "cell": stuck[2],
                                                 "check": stuck[3], "message": stuck[4]},
            "last": last}


# --------------------------------------------------------------------------- showing it (the page, the notebook)


STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}"
         ".pass{color:#1a7f37}.fail{color:#cf222e}")


def page_html(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")


def lessons_html(record: dict, lessons: list[str]) -> str:
    e = html.escape
    items = []
    for lesson in lessons:
        entry = record.get(lesson, {})
        if entry.get("finished"):
            state = "<span class=pass>run to the end</span>"
        elif entry.get("ran"):
            state = f"{entry['ran']} of {entry.get('cells', '?')} code cells run"
        else:
            state = "not started"
        items.append(f"<li>{e(lesson)}: {state}</li>")
    return f"<h2>Lessons</h2><ul>{''.join(items)}</ul>" if items else ""


def student_html(username: str, record: dict, lessons: list[str] = ()) -> str:
    e = html.escape
    intro = lessons_html(record, list(lessons))
    if not record:
        return page_html(f"Progress of {username}",
                     intro + "<p>Nothing recorded yet: run a lesson or a check in your lab.</p>")
    rows = []
    for notebook, entry in sorted(record.items()):
        parts = []
        if "cells" in entry:
            state = "run to the end" if entry.get("finished") else f"{entry.get('ran', 0)} of {entry['cells']} cells run"
            parts.append(e(state))
        for grade_id, test in sorted(entry.get("tests", {}).items()):
            mark = "<span class=pass>passed</span>" if test["passed"] else "<span class=fail>failed</span>"
            detail = "" if test["passed"] else f": {e(test['message'] or test['check'])}"
            parts.append(f"{e(grade_id)} {mark}{detail} ({test['tries']} tries)")
        hints = entry.get("hints", [])
        if hints:
            parts.append(f"{len(hints)} hint(s) asked: " + e(", ".join(sorted({h['check'] for h in hints}))))
        rows.append(f"<tr><td>{e(notebook)}</td><td>{'<br>'.join(parts)}</td><td>{e(entry.get('updated', ''))}</td></tr>")
    table = "<table><tr><th>notebook</th><th>what ran</th><th>last change</th></tr>" + "".join(rows) + "</table>"
    return page_html(f"Progress of {username}", intro + "<h2>Notebooks</h2>" + table)


def show_progress() -> None:
    """Show your own progress in the notebook (``course.show_progress()``), as the class server's page shows it."""
    record, workspace = os.environ.get(PROGRESS_ENV), os.environ.get(WORKSPACE_ENV)
    if not record or not workspace:
        print("Progress is recorded on the class server only (ddp-course hub): nothing to show here.")
        return
    lessons = sorted(f"lessons/{p.name}" for p in (Path(workspace) / "lessons").glob("*.ipynb"))
    page = student_html(os.environ.get("JUPYTERHUB_USER", "you"), clean(_load(Path(record))), lessons)
    try:
        from IPython.display import HTML, display
    except ImportError:  # a plain Python: the page's text
        print(page)
        return
    display(HTML(page))
