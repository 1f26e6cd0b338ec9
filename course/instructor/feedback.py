"""``ddp-course feedback``: an HTML page per student and assignment, without hidden tests.

nbgrader's generate_feedback writes ``feedback/<student>/<assignment>/<notebook>.html``:
each test cell with its score and output (a failed check's message says what
went wrong, hint level 1, and how to ask for the next: :mod:`course.grading.hints`). :class:`~course.instructor.redact.RedactHiddenTests`
takes the hidden tests out first (nbgrader #917); then every page is read back
and one that still shows a hidden test line is deleted and reported, and each
page gets a style that wraps long output lines (a check's message, a traceback)
instead of cutting them off at the page's right edge and draws the instructions'
tables; its contents name each test cell by what its check checks
(:mod:`course.instructor.checknames`).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import click

from course.errors import CourseError
from course.instructor.checknames import as_html, describe_notebook
from course.instructor.coursedir import Course, course_dir_option
from course.instructor.leaks import HIDDEN_TESTS, find_in_text, markers_in, secrets_of
from course.instructor.material import survey


class FeedbackLeak(CourseError):
    """A feedback page still shows hidden test source."""


#: long lines of outputs (messages, tracebacks) wrap in the page instead of running off its right edge; the
#: instructions' markdown tables get borders and padding (the page's reset style sets cells' padding to 0, so a
#: header "part | you write" read as "partyou write")
WRAP_STYLE = ('<style id="ddp-course-wrap">'
              ".output_area pre, .output_subarea pre, .jp-OutputArea-output pre, div.output_text pre "
              "{white-space: pre-wrap; overflow-wrap: anywhere;}"
              ".rendered_html table {border-collapse: collapse; margin: 0.5em 0;}"
              ".rendered_html th, .rendered_html td {border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: left;"
              " vertical-align: top;}"
              "</style>")
#: nbgrader's table of contents: ``<a href="#GRADE_ID">Test cell</a>``, the same words for every check
_TOC_LINK = re.compile(r'<a href="#([^"]+)">Test cell</a>')


def wrap_long_lines(page: Path) -> None:
    """Add :data:`WRAP_STYLE` to an HTML page (once)."""
    text = page.read_text(errors="replace")
    if 'id="ddp-course-wrap"' in text:
        return
    at = text.find("</head>")
    text = text[:at] + WRAP_STYLE + text[at:] if at >= 0 else WRAP_STYLE + text
    page.write_text(text)


def name_test_links(page: Path, descriptions: dict[str, str]) -> None:
    """Each "Test cell" link of the page's contents says what its check checks (and its id); the description's
    code spans are ``<code>`` (:func:`~course.instructor.checknames.as_html`)."""
    text = page.read_text(errors="replace")

    def named(match: re.Match) -> str:
        grade_id = html.unescape(match.group(1))
        about = descriptions.get(grade_id)
        label = f"{html.escape(grade_id)}: {as_html(about)}" if about else html.escape(grade_id)
        return f'<a href="#{match.group(1)}">{label}</a>'

    page.write_text(_TOC_LINK.sub(named, text))


def ensure_redaction(config) -> None:
    """Make GenerateFeedback run RedactHiddenTests even if the course's config predates it."""
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    from course.instructor.redact import RedactHiddenTests

    current = list(config.GenerateFeedback.get("preprocessors", [GetGrades, CSSHTMLHeaderPreprocessor]))
    if RedactHiddenTests not in current:
        at = current.index(GetGrades) + 1 if GetGrades in current else 0
        current.insert(at, RedactHiddenTests)
        config.GenerateFeedback.preprocessors = current


def page_leaks(course: Course, assignment: str, page: Path) -> list[str]:
    """Hidden test lines (or markers) a feedback page shows; empty when it is clean."""
    source = course.folder("source", assignment=assignment) / f"{page.stem}.ipynb"
    text = page.read_text(errors="replace")
    secrets = secrets_of(source).hidden_tests if source.is_file() else set()
    found = [m for m in markers_in(text) if m in HIDDEN_TESTS]
    return found + find_in_text(text, secrets)


def stray_files(course: Course, assignment: str, student: str) -> list[str]:
    """Delete from a student's feedback folder every file that is neither a page, nor the student's own
    submitted file, nor clean declared material (nbgrader copies the autograded folder's files there, and
    autograde copied source/'s into that); returns one line for each file deleted."""
    folder = course.folder("feedback", student, assignment)
    submitted = course.folder("submitted", student, assignment)
    material = survey(folder, course.folder("source", assignment=assignment))
    refused = []
    for item in material.refused:
        path = folder / item.path
        if not path.is_file() or path.suffix == ".html" and path.parent == folder:
            continue  # a declared file absent from feedback is no leak; pages are checked by page_leaks
        own = submitted / item.path
        if own.is_file() and own.read_bytes() == path.read_bytes():
            continue  # the student's own file, handed back as nbgrader does
        path.unlink()
        refused.append(f"{path.relative_to(course.root)}: {item.reason}")
    return refused


def generate_feedback(course: Course, assignments: list[str], students: tuple[str, ...] = ()) -> list[Path]:
    """Write feedback for every autograded submission of ``assignments``; returns the pages written."""
    ensure_redaction(course.api.config)  # the config GenerateFeedback (parent=api) reads
    pages, leaks, strays = [], [], []
    for assignment in assignments:
        graded = sorted(p.parent.name for p in course.folder("autograded").glob(f"*/{assignment}"))
        chosen = [s for s in graded if not students or s in students]
        if not chosen:
            continue
        # one nbgrader run per assignment (its HTML exporter starts once), or one per named student
        for student in (chosen if students else [None]):
            result = course.api.generate_feedback(assignment, student, force=True)
            if not result["success"]:
                raise CourseError(
                    f"nbgrader generate_feedback {assignment} failed:\n{result.get('error') or result.get('log')}"
                )
        for student in chosen:
            strays += stray_files(course, assignment, student)
            for page in sorted(course.folder("feedback", student, assignment).glob("*.html")):
                found = page_leaks(course, assignment, page)
                if found:
                    page.unlink()
                    leaks.append(f"{page.relative_to(course.root)}: {', '.join(repr(s) for s in found)}")
                else:
                    wrap_long_lines(page)
                    source = course.folder("source", assignment=assignment) / f"{page.stem}.ipynb"
                    name_test_links(page, describe_notebook(source) if source.is_file() else {})
                    pages.append(page)
    parts = []
    if leaks:
        parts.append("feedback pages showing hidden tests were deleted:\n  " + "\n  ".join(leaks))
    if strays:
        parts.append("files that are not student material were deleted from feedback (remove them from source/, or "
                     "declare a file students need in its notebook's metadata):\n  " + "\n  ".join(strays))
    if parts:
        raise FeedbackLeak("\n".join(parts))
    return pages


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--student", "students", multiple=True, help="Only this student (repeatable).")
@course_dir_option
def command(assignments, students, course_dir):
    """Write HTML feedback (score per check, failure messages, no hidden tests) for every graded submission."""
    course = Course.open(course_dir)
    pages = generate_feedback(course, course.pick_assignments(assignments), course.pick_students(students))
    for page in pages:
        click.echo(f"wrote {page.relative_to(course.root)}")
    click.echo(f"{len(pages)} feedback page(s); none shows hidden tests")
