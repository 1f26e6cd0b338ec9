"""What students may be given: the course's declared student material, and the check every copied file passes.

A folder of the course (an assignment's folder of source notebooks, or ``lessons/``) gives students its
top-level notebooks and the files those notebooks declare in their metadata, and nothing else::

    "metadata": {"ddp_course": {"student_files": ["buggy_training.py"]}}

Any other file beside them (a script a source notebook wrote when run in place, a helper module, a draft)
is *not student material*: :func:`survey` refuses it with the reason, and every verb that copies course
material towards students (``init``, ``release``, ``lab`` and the lab image, ``feedback``) leaves it out,
names it and exits non-zero. A declared file is checked too (:func:`file_leaks`): no solution or hidden-test
region marker, no hidden-test line, not the whole answer of a solution cell of the notebook that declares it
(a given script the student fixes shares most of its lines with the fix, never all), and not half or more of
another notebook's answer (idioms such as ``if rank == 0:`` are shared by every script). A solution line is a secret only where the student
cannot read it anyway: in the visible cells of the folder's notebooks or in another declared file.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course.instructor.leaks import (
    HIDDEN_TESTS,
    SOLUTION,
    find_in_text,
    is_meaningful,
    markers_in,
    split_regions,
)

#: the notebook metadata that declares student files: ``metadata[KEY][FILES]``, a list of relative paths
KEY, FILES = "ddp_course", "student_files"
#: never material, never reported: editors' and Python's caches
_SKIPPED = {"__pycache__", ".ipynb_checkpoints"}


@dataclass
class Refused:
    """A file that must not reach students, and why (one line)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class Survey:
    """One folder sorted: its notebooks, its declared files (checked, clean), and what was refused."""

    folder: Path
    notebooks: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)


def declared_files(nb) -> list[str]:
    """The student files a notebook (a NotebookNode) declares; raises ValueError for a malformed declaration."""
    names = nb.metadata.get(KEY, {}).get(FILES, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"metadata {KEY}.{FILES} must be a list of file names")
    for name in names:
        norm = posixpath.normpath(name)
        if name.startswith("/") or norm.startswith("..") or norm == "." or name.endswith(".ipynb"):
            raise ValueError(f"metadata {KEY}.{FILES} names {name!r}: give a file inside the notebook's folder "
                             "(notebooks are material by themselves)")
    return [posixpath.normpath(n) for n in names]


def _read_notebook(path: Path):
    try:
        return nbformat.read(str(path), as_version=4)
    except Exception as err:  # noqa: BLE001 - any unreadable notebook is one reason
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"not a notebook ({type(err).__name__}{': ' + first if first else ''})") from None


def _meaningful_code(lines) -> set[str]:
    markers = (*SOLUTION, *HIDDEN_TESTS)
    return {line.strip() for line in lines if is_meaningful(line) and not line.strip().startswith("#")
            and not any(m in line for m in markers)}


@dataclass
class _Regions:
    """One source notebook's text, split: what every reader sees, each solution region, the hidden tests."""

    public: set[str]
    solutions: list[tuple[str, set[str]]]  # (cell id, the region's code lines)
    hidden: set[str]


def _regions(nb) -> _Regions:
    public, solutions, hidden = set(), [], set()
    for index, cell in enumerate(nb.cells):
        name = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"cell {index + 1}"
        hid_in, rest = split_regions(cell.source, HIDDEN_TESTS)
        hidden |= _meaningful_code(hid_in)
        sol_in, rest = split_regions("\n".join(rest), SOLUTION)
        begin, end, depth, region = *SOLUTION, 0, []
        for line in sol_in:  # one entry per region, so "the whole answer of a cell" is per region
            if begin in line:
                depth += 1
            elif end in line:
                depth -= 1
                if depth == 0 and region:
                    solutions.append((name, _meaningful_code(region)))
                    region = []
            else:
                region.append(line)
        public |= {line.strip() for line in rest}
    return _Regions(public, solutions, hidden)


def file_leaks(text: str, rel: str, sources: dict[str, _Regions], declared_by: set[str],
               given: set[str]) -> list[str]:
    """What makes file ``rel`` (its ``text``) unfit for students; empty when clean.

    ``sources``: notebook name -> its regions; ``declared_by``: the notebooks that declare ``rel``;
    ``given``: the lines of the folder's other declared files (the student has those anyway).
    """
    problems = [f"it holds the region marker {m!r}" for m in markers_in(text)]
    public = given.union(*(r.public for r in sources.values())) if sources else set(given)
    public_text = "\n".join(public)
    for name, regions in sources.items():
        hidden = {h for h in regions.hidden if h not in public_text}
        found = find_in_text(text, hidden)
        if found:
            problems.append(f"it holds {len(found)} hidden test line(s) of {name}, e.g. {found[0]!r}")
        for cell, code in regions.solutions:
            secret = {line for line in code if line not in public_text}
            found = find_in_text(text, secret)
            if not found:
                continue
            if not declared_by:  # a file nobody declared: any line of an answer is named
                problems.append(f"it holds {len(found)} line(s) of {name}'s reference solution ({cell}), "
                                f"e.g. {found[0]!r}")
            elif len(found) == len(secret) or (name not in declared_by and _most_of(found, secret)):
                problems.append(f"it holds {len(found)} of the {len(secret)} lines of {name}'s answer in its solution "
                                f"cell {cell}, e.g. {found[0]!r}")
    return problems


def _most_of(found: list[str], secret: set[str]) -> bool:
    """Half of an answer's own lines or more (two at least): more than the idioms a given script shares with it."""
    return len(found) >= 2 and 2 * len(found) >= len(secret)


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def survey(folder: Path, sources: Path | None = None, *, notebook_glob: str = "*.ipynb") -> Survey:
    """Sort every file under ``folder`` into notebooks, declared and clean files, and refused files.

    ``sources``: the folder whose notebooks declare the files and whose solutions they are checked against
    (default: ``folder`` itself; ``release/A`` is checked against ``source/A``). Notebooks are the top-level
    ``*.ipynb`` of ``folder``; a notebook the declarations cannot be read from is refused.
    """
    folder = Path(folder)
    sources = Path(sources) if sources is not None else folder
    result = Survey(folder)
    regions: dict[str, _Regions] = {}
    declared: dict[str, set[str]] = {}
    for path in sorted(sources.glob("*.ipynb")):
        try:
            nb = _read_notebook(path)
            names = declared_files(nb)
        except ValueError as why:
            if sources == folder:
                result.refused.append(Refused(path.name, str(why)))
            continue
        regions[path.name] = _regions(nb)
        for name in names:
            declared.setdefault(name, set()).add(path.name)
    refused_notebooks = {r.path for r in result.refused}
    candidates = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if not path.is_file() or _SKIPPED.intersection(path.relative_to(folder).parts):
            continue
        if path.parent == folder and path.suffix == ".ipynb":
            if rel not in refused_notebooks:
                result.notebooks.append(path)
            continue
        candidates.append((rel, path))
    texts = {rel: _text(path) for rel, path in candidates if rel in declared}
    every_given = {line.strip() for text in texts.values() for line in text.splitlines()}
    present = {rel for rel, _ in candidates}
    for rel in sorted(set(declared) - present):
        result.refused.append(Refused(rel, f"declared by {', '.join(sorted(declared[rel]))} but missing"))
    for rel, path in candidates:
        if rel not in declared:
            text = _text(path)
            held = file_leaks(text, rel, regions, set(), every_given)
            what = f"; {held[0]}" if held else ""
            result.refused.append(Refused(rel, f"not student material (no notebook here declares it in its "
                                               f"metadata {KEY}.{FILES}){what}"))
            continue
        given = {line.strip() for other, text in texts.items() if other != rel for line in text.splitlines()}
        problems = file_leaks(texts[rel], rel, regions, declared[rel], given)
        if problems:
            result.refused.append(Refused(rel, "; ".join(problems)))
        else:
            result.files.append(path)
    return result


def refusal_lines(refused: list[Refused], prefix: str = "") -> list[str]:
    """One line per refused file, for a verb's output."""
    return [f"not copied: {prefix}{r}" for r in refused]
