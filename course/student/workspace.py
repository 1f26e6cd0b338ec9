"""A student's workspace: the lessons and the student copies of the exercises, in a folder of their own.

``ddp-course lab`` makes it on its first start and brings it up to date on every later one
(:func:`sync`). Exercise notebooks are made exactly as ``ddp-course release`` makes them
(nbgrader's generate_assignment preprocessors, without its gradebook) and checked for leaks
(:mod:`course.instructor.leaks`) before they are written: no solution and no hidden test
ever lands in the folder. Besides notebooks, a folder gives only the files its notebooks
declare, each checked (:mod:`course.instructor.material`); anything else found beside them
is left out and named. A course whose exercises are student copies already (the lab
image's) is copied as it is, after the same check for region markers.

The manifest (:data:`MANIFEST`) records the hash of every file as it was installed, so a
later start tells a file the student changed (kept; a newer original is written beside it as
``NAME.updated.ipynb``) from one they did not touch (updated in place), puts back a file that
is gone (deleting a notebook is how to start it over) and adds what is new. For each exercise
notebook it also records how many hidden checks each test cell has (a count, never their
text): ``ddp-course check`` says "N hidden variants are graded too" from it.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from course.errors import CourseError

#: the workspace's record of what it was given (a JSON file at its top)
MANIFEST = ".ddp-course-workspace.json"
#: the folders of a course that a workspace holds
FOLDERS = ("lessons", "exercises")
#: where a workspace is made when neither --dir nor this variable names one (and the current folder is none)
WORKSPACE_ENV = "DDP_COURSE_WORKSPACE"
DEFAULT_NAME = "ddp-course-work"
_SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}


class WorkspaceError(CourseError):
    """The workspace folder cannot be used (a file, not writable, inside the course's sources)."""


@dataclass
class Item:
    """One file of the course's student edition, as the workspace gets it."""

    #: path inside the workspace, with forward slashes (``exercises/ex1-parallelism/parallelism.ipynb``)
    path: str
    data: bytes
    #: test cell grade_id -> how many hidden checks it has (exercise notebooks only)
    hidden: dict[str, int] = field(default_factory=dict)


@dataclass
class SyncReport:
    """What one :func:`sync` did."""

    workspace: Path
    added: list[str] = field(default_factory=list)
    #: files the workspace had had and that were gone (deleted to start over): a fresh copy
    restored: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    #: (the student's file, kept; the course's newer original, written beside it)
    offered: list[tuple[str, str]] = field(default_factory=list)
    #: course files that were not installed, and why
    problems: list[str] = field(default_factory=list)
    files: int = 0

    def lines(self) -> list[str]:
        out = [f"workspace {self.workspace}: {self.files} course files"
               + (f", {len(self.added)} added" if self.added else "")
               + (f", {len(self.restored)} restored" if self.restored else "")
               + (f", {len(self.updated)} updated" if self.updated else "")]
        if self.added and len(self.added) < self.files:
            out += [f"  new: {p}" for p in self.added]
        out += [f"  fresh copy (it was gone): {p}" for p in self.restored]
        out += [f"  updated (you had not changed it): {p}" for p in self.updated]
        out += [f"  kept your {mine}; the course's new version is beside it: {theirs}" for mine, theirs in self.offered]
        out += [f"  not installed: {p}" for p in self.problems]
        return out


# --------------------------------------------------------------------------- the course's student edition


def is_source_notebook(nb) -> bool:
    """Whether ``nb`` is an nbgrader source notebook (solution or hidden-test regions), not a student copy."""
    from course.instructor.leaks import HIDDEN_TESTS, SOLUTION

    return any(m in cell.get("source", "") for cell in nb.cells for m in (SOLUTION[0], HIDDEN_TESTS[0]))


def release_notebook(source, assignment: str, name: str):
    """The student copy of the source notebook ``source``, made by generate_assignment's own preprocessors.

    Every step ``ddp-course release`` runs, in its order, except SaveCells (it writes the gradebook,
    which a student has not got); the source is not changed.
    """
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import SaveCells
    from traitlets.config import Config

    nb = copy.deepcopy(source)
    resources = {"nbgrader": {"notebook": name, "assignment": assignment}, "metadata": {"name": name}}
    for step in GenerateAssignment.class_traits()["preprocessors"].default():
        if step is not SaveCells:
            nb, resources = step(config=Config())(nb, resources)
    return nb


def _hidden_region_count(source: str) -> int:
    """Hidden variants of a test cell: for a cell of check calls, the calls with a hidden line (a hidden call, or a
    visible call whose hidden arguments make the autograder judge another case); else the hidden statements."""
    from course.grading.checkcalls import parse
    from course.instructor.leaks import HIDDEN_TESTS, is_meaningful, split_regions

    calls = parse(source)
    if calls is not None:
        return sum(1 for call in calls if call.hidden)
    inside, _ = split_regions(source, HIDDEN_TESTS)
    body = [line for line in inside if not any(m in line for m in HIDDEN_TESTS)]
    try:
        return len(ast.parse(textwrap.dedent("\n".join(body))).body)
    except SyntaxError:
        return sum(1 for line in body if is_meaningful(line))


def hidden_variants(source) -> dict[str, int]:
    """Test cell grade_id -> the number of statements (check calls) in its hidden-test regions, where any."""
    from course.grading.cells import holds_hidden_tests, is_test_cell, nbgrader_meta

    counts = {}
    for cell in source.cells:
        if is_test_cell(cell) and holds_hidden_tests(cell.source):
            count = _hidden_region_count(cell.source)
            if count:
                counts[str(nbgrader_meta(cell).get("grade_id"))] = count
    return counts


def _exercise_item(rel: str, path: Path, recorded: dict) -> Item:
    """An exercise notebook as a student gets it; raises ValueError (the reason) when it must not be installed."""
    import nbformat

    from course.instructor.leaks import markers_in, notebook_leaks, notebook_text, secrets_of

    try:
        nb = nbformat.reads(path.read_text(), as_version=4)
    except Exception as err:  # noqa: BLE001 - any unreadable notebook is one reason
        raise ValueError(f"not a notebook ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    if not is_source_notebook(nb):  # a student copy already (the lab image's course): checked, kept as it is
        markers = markers_in(notebook_text(nb))
        if markers:
            raise ValueError(f"it shows {', '.join(markers)}")
        return Item(rel, path.read_bytes(), dict(recorded.get(rel, {}).get("hidden", {})))
    student = release_notebook(nb, path.parent.name, path.stem)
    leaks = notebook_leaks(secrets_of(nb), student)
    if leaks:
        raise ValueError("its student copy would leak: " + "; ".join(leaks))
    return Item(rel, (nbformat.writes(student) + "\n").encode(), hidden_variants(nb))


def _lesson_item(rel: str, path: Path) -> Item:
    """A lesson notebook as a student gets it (as it is); raises ValueError (the reason) when it must not be."""
    import nbformat

    from course.instructor.leaks import markers_in, notebook_text

    try:
        nb = nbformat.reads(path.read_text(), as_version=4)
    except Exception as err:  # noqa: BLE001 - any unreadable notebook is one reason
        raise ValueError(f"not a notebook ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    markers = markers_in(notebook_text(nb))
    if markers:
        raise ValueError(f"it shows {', '.join(markers)}")
    return Item(rel, path.read_bytes())


def _material_folders(course: Path):
    """(the course's folders whose files students may get, each a folder of notebooks with their declared files:
    ``lessons/`` and each assignment under ``exercises/``; files directly in ``exercises/``)"""
    folders = []
    lessons, exercises = course / "lessons", course / "exercises"
    if lessons.is_dir():
        folders.append(lessons)
    loose = []
    if exercises.is_dir():
        for path in sorted(exercises.iterdir()):
            if path.name.startswith(".") or path.name in _SKIP_PARTS:
                continue
            (folders if path.is_dir() else loose).append(path)
    return folders, loose


def student_edition(course: Path) -> tuple[list[Item], list[str]]:
    """(every file a workspace gets from the course at ``course``, the files left out and why).

    Each folder gives its notebooks and the files they declare (:mod:`course.instructor.material`), each
    checked; anything else (a script a source notebook wrote in place, a draft) is left out and named.
    """
    from course.instructor.material import survey

    recorded = read_manifest(course).get("files", {})  # a course that is itself a workspace (the lab image's)
    items, problems = [], []
    folders, loose = _material_folders(course)
    problems += [f"{p.relative_to(course).as_posix()}: not student material (not inside an assignment's folder)"
                 for p in loose]
    for folder in folders:
        material = survey(folder)
        problems += [f"{folder.relative_to(course).as_posix()}/{r}" for r in material.refused]
        is_lessons = folder.name == "lessons" and folder.parent == course
        for path in material.notebooks:
            rel = path.relative_to(course).as_posix()
            try:
                items.append(_lesson_item(rel, path) if is_lessons else _exercise_item(rel, path, recorded))
            except ValueError as why:
                problems.append(f"{rel}: {why}")
        items += [Item(path.relative_to(course).as_posix(), path.read_bytes()) for path in material.files]
    return items, problems


# --------------------------------------------------------------------------- the workspace


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(workspace: Path) -> dict:
    try:
        manifest = json.loads((workspace / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def find_workspace(path: Path) -> Path | None:
    """The workspace that holds ``path`` (the nearest folder above it with a manifest), if any."""
    for folder in Path(path).resolve().parents:
        if (folder / MANIFEST).is_file():
            return folder
    return None


def default_workspace() -> Path:
    """$DDP_COURSE_WORKSPACE; else the current folder if it is a workspace; else ~/ddp-course-work."""
    if os.environ.get(WORKSPACE_ENV):
        return Path(os.environ[WORKSPACE_ENV]).expanduser()
    if (Path.cwd() / MANIFEST).is_file():
        return Path.cwd()
    return Path.home() / DEFAULT_NAME


def check_folder(workspace: Path, course: Path) -> Path:
    """The workspace's resolved path, or :class:`WorkspaceError` (one line) when it cannot be one. Writes nothing."""
    ws = Path(workspace).expanduser().resolve()
    src = Path(course).resolve()
    if ws.exists() and not ws.is_dir():
        raise WorkspaceError(f"{workspace} is a file, not a folder: choose a folder for your workspace with --dir")
    if ws == src or src in ws.parents:
        raise WorkspaceError(f"{workspace} is inside the course's sources ({src}), where the lab would show the "
                             "solutions: choose a folder outside it with --dir")
    if ws in src.parents:
        raise WorkspaceError(f"{workspace} holds the course's sources ({src}), so the lab would show the solutions: "
                             "choose a folder outside it with --dir")
    existing = next(p for p in (ws, *ws.parents) if p.exists())
    if not existing.is_dir():
        raise WorkspaceError(f"{workspace} cannot be made: {existing} is a file, not a folder; choose another with --dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WorkspaceError(f"{workspace} is not writable (no write permission on {existing}): choose a folder "
                             "of yours with --dir")
    return ws


def _write_new(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file beside it (a reader never sees half a notebook)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.ddp-course-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _beside(path: Path, data: bytes) -> Path:
    """A free name beside ``path`` for the course's new version (``NAME.updated.ipynb``, then ``-2``, ...)."""
    for n in range(1, 100):
        candidate = path.with_name(f"{path.stem}.updated{'' if n == 1 else f'-{n}'}{path.suffix}")
        if not candidate.exists() or candidate.read_bytes() == data:
            return candidate
    raise WorkspaceError(f"too many updated copies beside {path}: delete the old ones")


def sync(workspace: Path, course: Path, only: tuple[str, ...] | None = None) -> SyncReport:
    """Make the workspace, or bring it up to date with the course at ``course``; never overwrites a student's change.

    For every file of the course's student edition: a file the workspace lacks is written; one the student
    has not changed since it was installed is replaced by the course's version when that differs; one the
    student changed (or that was there before the workspace knew it) is kept, and the course's version,
    when it differs, is written beside it. The manifest then records what each file was installed as.
    ``only``: the course's top folders the workspace takes (a class server's workspace takes ``lessons`` only:
    its assignments arrive through nbgrader's exchange).
    """
    ws = check_folder(workspace, course)
    items, problems = student_edition(course)
    if only is not None:
        items = [item for item in items if item.path.split("/", 1)[0] in only]
    report = SyncReport(ws, problems=problems, files=len(items))
    manifest = read_manifest(ws)
    files = manifest.get("files", {}) if isinstance(manifest.get("files"), dict) else {}
    ws.mkdir(parents=True, exist_ok=True)
    for item in items:
        target = ws / item.path
        new = digest(item.data)
        recorded = files.get(item.path, {}).get("sha256")
        if not target.exists():
            _write_new(target, item.data)
            (report.restored if recorded else report.added).append(item.path)
        elif target.is_file():
            current = digest(target.read_bytes())
            if current == recorded and new != recorded:
                _write_new(target, item.data)
                report.updated.append(item.path)
            elif current != new and new != recorded:  # the student's file; offer the course's version beside it
                beside = _beside(target, item.data)
                if not beside.exists():
                    _write_new(beside, item.data)
                    report.offered.append((item.path, beside.relative_to(ws).as_posix()))
        else:
            report.problems.append(f"{item.path}: a folder of yours has its name")
            continue
        files[item.path] = {"sha256": new, **({"hidden": item.hidden} if item.hidden else {})}
    manifest.update({"format": 1, "course": str(Path(course).resolve()), "files": files})
    _write_new(ws / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return report


def broken_notebooks(workspace: Path) -> list[str]:
    """One line for each notebook of the workspace that JupyterLab cannot open (not JSON, not a notebook)."""
    lines = []
    for path in sorted(_notebooks(Path(workspace))):
        rel = path.relative_to(workspace)
        try:
            nb = json.loads(path.read_text(errors="replace"))
            if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
                raise ValueError("no list of cells")
        except ValueError as err:
            lines.append(f"{rel} is broken, JupyterLab cannot open it ({str(err).splitlines()[0]}): repair it in "
                         "a text editor, or rename it and start the lab again to get a fresh copy")
    return lines


def _notebooks(folder: Path):
    """The notebooks under ``folder``, never looking into hidden folders (a home folder's caches, environments)."""
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_PARTS and d != "node_modules"]
        yield from (Path(top) / f for f in files if f.endswith(".ipynb") and not f.startswith("."))
