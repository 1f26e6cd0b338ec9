"""No solution code in what ships to students: ``graders/`` is on a student's path (the visible tests import it),
so a grader helper that holds a solution's code hands it over, importable (issue 38).

A *solution window* is a run of WINDOW consecutive code tokens (comments and layout dropped, every string literal
one token) of a ``### BEGIN SOLUTION`` region of a source exercise notebook that occurs nowhere in what students
are given anyway (the lessons, the exercises' visible cells, the exercises' given files). A grader module that
holds a solution window carries a solution's code. The one known case is listed in KNOWN with its reason; any
other fails, and so does a KNOWN entry that no longer matches (so the list cannot go stale).
"""

from __future__ import annotations

import io
import textwrap
import tokenize
from pathlib import Path

import nbformat
import pytest

from course.instructor.leaks import HIDDEN_TESTS, SOLUTION, split_regions

ROOT = Path(__file__).resolve().parent.parent
#: tokens in a window: 20 finds a 5-line helper (the bucket rule's loop is 55 tokens); at 14, a comprehension
#: like ``torch.cat([g.reshape(-1) for g in grads])`` would count, which is the language's idiom, not a solution
WINDOW = 20
#: (grader module, notebook) pairs known to share a solution window, and why it stays for now
KNOWN = {
    ("ddp_basics/sampler.py", "debug_training.ipynb"):
        "the DataLoader-with-sampler loop calling sampler.set_epoch(epoch) at each epoch: lesson 2 teaches that loop "
        "(other names), the sampler check's reference runs it; the drill's fix is finding that it is missing",
}
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
         tokenize.ENDMARKER}


def _tokens(text: str) -> list[str]:
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(text)).readline):
            if tok.type not in _SKIP:
                out.append("STR" if tok.type == tokenize.STRING else tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a region cut mid-statement: the tokens read so far still count
    return out


def _windows(tokens: list[str]) -> set[str]:
    return {"\x00".join(tokens[i:i + WINDOW]) for i in range(len(tokens) - WINDOW + 1)}


def _solutions() -> dict[str, set[str]]:
    """notebook name -> the windows of its solution regions."""
    out: dict[str, set[str]] = {}
    for path in sorted(ROOT.glob("exercises/*/*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        windows: set[str] = set()
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            inside, _ = split_regions(cell.source, SOLUTION)
            code = [line for line in inside if not any(m in line for m in SOLUTION)]
            windows |= _windows(_tokens("\n".join(code)))
        out[path.name] = windows
    return out


def _public() -> set[str]:
    """The windows of everything students are given anyway."""
    windows: set[str] = set()
    for path in sorted(ROOT.glob("lessons/*.ipynb")) + sorted(ROOT.glob("exercises/*/*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            _, rest = split_regions(cell.source, SOLUTION)
            _, rest = split_regions("\n".join(rest), HIDDEN_TESTS)
            windows |= _windows(_tokens("\n".join(rest)))
    for path in sorted(ROOT.glob("exercises/*/*.py")):
        windows |= _windows(_tokens(path.read_text()))
    return windows


def shared_windows() -> dict[tuple[str, str], list[str]]:
    """(grader module, notebook) -> the solution windows (as text) the module holds."""
    public = _public()
    graders = {path.relative_to(ROOT / "graders").as_posix(): _windows(_tokens(path.read_text()))
               for path in sorted(ROOT.glob("graders/**/*.py"))}
    found: dict[tuple[str, str], list[str]] = {}
    for notebook, windows in _solutions().items():
        secret = windows - public
        for module, held in graders.items():
            hits = secret & held
            if hits:
                found[(module, notebook)] = sorted(" ".join(w.split("\x00")) for w in hits)
    return found


def test_the_window_finds_a_copied_helper():
    """The measure can fail: a solution's loop copied into a module is found, renamed variables or not."""
    loop = ("buckets, current, size = [], [], 0\nfor name, p in reversed(list(model.named_parameters())):\n"
            "    nbytes = p.numel() * p.element_size()\n    if current and size + nbytes > limit:\n"
            "        buckets.append(current)\n        current, size = [], 0\n")
    assert _windows(_tokens(loop)) & _windows(_tokens("def helper(model, limit):\n" + textwrap.indent(loop, "    ")))
    assert not _windows(_tokens("torch.cat([g.reshape(-1) for g in grads])"))  # an idiom: too short to count


@pytest.mark.timeout(120)
def test_no_grader_holds_solution_code():
    found = shared_windows()
    unknown = {pair: hits for pair, hits in found.items() if pair not in KNOWN}
    assert not unknown, "grader modules that hold solution code (students import graders/):\n" + "\n".join(
        f"  {module} holds {len(hits)} window(s) of {notebook}'s solution, e.g. {hits[0]!r}"
        for (module, notebook), hits in unknown.items())
    stale = [pair for pair in KNOWN if pair not in found]
    assert not stale, f"KNOWN lists pairs that no longer share solution code (remove them): {stale}"
