"""Feedback without hidden tests (nbgrader #917): a GenerateFeedback preprocessor.

At autograde nbgrader restores every test cell's full source, hidden tests
included, so feedback pages show them, in the cell and in tracebacks. This
preprocessor replaces each hidden-test region with a placeholder and blanks the
output lines that quote it, keeping everything else: scores, failure messages,
the student's own code. ``nbgrader_config.py`` (written by ``ddp-course init``)
installs it, so plain ``nbgrader generate_feedback`` is safe too.
"""

from __future__ import annotations

from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Unicode

from course.instructor.leaks import HIDDEN_TESTS, is_meaningful, plain_text, split_regions


def redact_source(source: str, placeholder: str) -> tuple[str, set[str]]:
    """``source`` with each hidden-test region replaced by ``placeholder``; also the lines removed."""
    begin, end = HIDDEN_TESTS
    out, removed, depth = [], set(), 0
    for line in source.splitlines():
        if begin in line:
            if depth == 0:
                indent = line[: len(line) - len(line.lstrip())]
                out.append(indent + placeholder)
            depth += 1
            removed.add(line.strip())
        elif end in line and depth:
            depth -= 1
            removed.add(line.strip())
        elif depth:
            removed.add(line.strip())
        else:
            out.append(line)
    return "\n".join(out), removed


def redact_text(text: str, secrets: set[str], replacement: str) -> str:
    """``text`` with every line that quotes a secret line replaced (tracebacks quote the failing source)."""
    lines = text.split("\n")
    return "\n".join(replacement if any(s in plain_text(line) for s in secrets) else line for line in lines)


class RedactHiddenTests(NbGraderPreprocessor):
    """Hide hidden-test source in feedback, keep the cell's score and failure messages."""

    placeholder = Unicode("# (hidden tests: not shown)", help="What replaces a hidden-test region.").tag(config=True)
    redacted_line = Unicode("[hidden test line not shown]", help="What replaces an output line quoting one.").tag(
        config=True
    )

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "code" or HIDDEN_TESTS[0] not in cell.source:
            return cell, resources
        _, outside = split_regions(cell.source, HIDDEN_TESTS)
        visible = {line.strip() for line in outside}
        cell.source, removed = redact_source(cell.source, self.placeholder)
        secrets = {line for line in removed - visible if is_meaningful(line)} | set(HIDDEN_TESTS)
        for output in cell.get("outputs", []):
            if "text" in output:
                output.text = redact_text(output.text, secrets, self.redacted_line)
            if "traceback" in output:
                output.traceback = [redact_text(entry, secrets, self.redacted_line) for entry in output.traceback]
            for mime, value in output.get("data", {}).items():
                if isinstance(value, str) and mime.startswith("text/"):
                    output.data[mime] = redact_text(value, secrets, self.redacted_line)
        return cell, resources
