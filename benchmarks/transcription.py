"""How much of each exercise's reference solution a student could copy instead of write (issue 27).

For every exercise notebook, the lines of its solution regions (``### BEGIN SOLUTION`` ...
``### END SOLUTION``, or a whole answer cell) are compared with two sources a student reads:

* the exercise's own instructions: every code span and code block of its markdown cells;
* the four lessons: every line of their code cells and of the code in their markdown.

A line counts when it is *substantial*: after removing comments and collapsing spaces it keeps at
least :data:`MIN_CHARS` characters and is not plain syntax (``else:``, ``return loss``...) or a
docstring (prose: any string alone has the same shape). It is

* **verbatim** when the same normalised line is in a source;
* **same shape** when the line equals a source line once every local name, number and string is
  replaced by a placeholder (attribute names, keywords and operators stay: ``dist.all_reduce(v)``
  and ``dist.all_reduce(grad)`` have one shape, ``dist.broadcast(p, 0)`` another).

Every line of a training loop counts too (``optimizer.step()`` a student copies is a copied line): an
exercise that wants no transcription gives the loop it does not grade, and asks for the part it does.

``python benchmarks/transcription.py`` prints the figures per notebook and in total;
``tests/test_exercise_rules.py`` keeps the instructions free of solution lines.
"""

from __future__ import annotations

import io
import keyword
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("*/*.ipynb"))
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))

#: a line shorter than this (after normalising) is syntax, not a piece of the answer
MIN_CHARS = 14
_BEGIN, _END = "### BEGIN SOLUTION", "### END SOLUTION"
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def normalise(line: str) -> str:
    """A line without its comment, indentation and repeated spaces."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
        out = " ".join(t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                                                  tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        out = line.split("#", 1)[0]
    out = re.sub(r"\s+", " ", out).strip()
    # the tokenizer spaces every token: put the usual spacing back so a span of prose code matches
    return re.sub(r" ?([().,\[\]:]) ?", r"\1", out)


def shape(line: str) -> str:
    """The line with local names, numbers and strings replaced: what a transcriber would adapt."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return normalise(line)
    parts, previous = [], None
    for tok in tokens:
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and previous != ".":
            parts.append("_")
        elif tok.type == tokenize.NUMBER:
            parts.append("0")
        elif tok.type == tokenize.STRING:
            parts.append("'s'")
        elif tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        else:
            parts.append(tok.string)
        previous = tok.string
    return " ".join(parts)


def substantial(norm: str) -> bool:
    if len(norm) < MIN_CHARS or norm.startswith(("import ", "from ", "%%", "def ", "class ", "@")):
        return False
    if re.fullmatch(r"[rbuf]*(\"\"\"|'\'\'|\"|').*\1", norm):  # a docstring: prose, every string one shape
        return False
    return not re.fullmatch(r"(return|raise|pass|else:|try:|finally:|continue|break)\b.{0,10}", norm)


def solution_lines(path: Path) -> list[str]:
    """The substantial lines of the notebook's solution regions."""
    lines = []
    for cell in nbformat.read(str(path), as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("solution"):
            continue
        source = cell.source.splitlines()
        if any(_BEGIN in line for line in source):
            inside = False
            for line in source:
                if _BEGIN in line:
                    inside = True
                elif _END in line:
                    inside = False
                elif inside:
                    lines.append(line)
        else:
            lines.extend(source)
    return [n for n in map(normalise, lines) if substantial(n)]


def instruction_code(path: Path) -> list[str]:
    """Every code span and every line of every code block in the notebook's markdown."""
    found = []
    for cell in nbformat.read(str(path), as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        for block in _FENCE.findall(text):
            found.extend(block.splitlines())
        found.extend(_SPAN.findall(_FENCE.sub("", text)))
    return [n for n in map(normalise, found) if n]


def lesson_code(paths=LESSONS) -> list[str]:
    found = []
    for path in paths:
        for cell in nbformat.read(str(path), as_version=4).cells:
            if cell.cell_type == "code":
                found.extend(cell.source.splitlines())
            elif cell.cell_type == "markdown":
                for block in _FENCE.findall(cell.source):
                    found.extend(block.splitlines())
    return [n for n in map(normalise, found) if n]


def given_by(line: str, spans: list[str]) -> str | None:
    """The instruction span that gives ``line`` away: the whole line, or most of it (a call to copy)."""
    for span in spans:
        if line in span:
            return span
        if len(span) >= 16 and span in line and len(span) >= 0.6 * len(line):
            return span
    return None


@dataclass
class Figures:
    lines: int = 0
    verbatim: list[str] = field(default_factory=list)
    same_shape: list[str] = field(default_factory=list)
    in_instructions: list[tuple[str, str]] = field(default_factory=list)


def measure(path: Path, lessons: list[str] | None = None) -> Figures:
    lessons = lesson_code() if lessons is None else lessons
    spans = instruction_code(path)
    sources = set(lessons) | set(spans)
    shapes = {shape(s) for s in sources}
    figures = Figures()
    for line in solution_lines(path):
        figures.lines += 1
        if line in sources or given_by(line, spans):
            figures.verbatim.append(line)
        elif shape(line) in shapes:
            figures.same_shape.append(line)
        span = given_by(line, spans)
        if span:
            figures.in_instructions.append((line, span))
    return figures


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    lessons = lesson_code()
    total = Figures()
    print(f"{'notebook':45} {'lines':>5} {'verbatim':>9} {'same shape':>11} {'in instructions':>16}")
    for path in EXERCISES:
        f = measure(path, lessons)
        total.lines += f.lines
        total.verbatim += f.verbatim
        total.same_shape += f.same_shape
        total.in_instructions += f.in_instructions
        name = f"{path.parent.name}/{path.name}"
        print(f"{name:45} {f.lines:5} {len(f.verbatim):9} {len(f.same_shape):11} {len(f.in_instructions):16}")
        if verbose:
            for line in f.verbatim:
                print(f"    verbatim:   {line}")
            for line in f.same_shape:
                print(f"    same shape: {line}")
    n = max(total.lines, 1)
    print(f"{'total':45} {total.lines:5} {len(total.verbatim):9} {len(total.same_shape):11} "
          f"{len(total.in_instructions):16}")
    print(f"verbatim {100 * len(total.verbatim) / n:.0f}%, verbatim or same shape "
          f"{100 * (len(total.verbatim) + len(total.same_shape)) / n:.0f}% of {total.lines} solution lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
