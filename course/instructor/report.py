"""``ddp-course report``: the class at a glance, on the terminal and as one HTML page with plots.

Per assignment the score distribution; per check its pass rate and its most common failure messages (grouped
by their first line, with counts), each check named by what it checks (:func:`~course.instructor.results.
check_descriptions`); per student what is missing; how long grading took. Everything is read, nothing written
but the page (:mod:`course.instructor.results` says where each fact comes from).

The plots are drawn by matplotlib (already the course's plotting library: the lessons use it) as SVG and put
inline in the page: the page is one self-contained file with no script, that opens offline and can be mailed
or archived as it is, and its text (check ids, labels) stays text. plotly would need its 3.5 MB JavaScript
library inline or a CDN the course machines may not reach.
"""

from __future__ import annotations

import html
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click

from course.instructor.checknames import as_html
from course.instructor.coursedir import Course, course_dir_option, write_whole
from course.instructor.results import INTERRUPTED, Result, check_label, class_results, source_checks

#: failure messages listed per check (the most common first)
TOP_FAILURES = 3
#: score distribution bins (fractions of the assignment's points)
BINS = 5


@dataclass
class CheckStats:
    assignment: str
    notebook: str
    grade_id: str
    description: str
    max_points: float
    graded: int = 0
    passed: int = 0
    #: first line of the failure message -> how many submissions failed with it
    failures: Counter = field(default_factory=Counter)

    @property
    def label(self) -> str:
        """Its id and what it checks, as rich markup (code spans styled)."""
        return check_label(self.grade_id, self.description)

    @property
    def rate(self) -> float | None:
        return self.passed / self.graded if self.graded else None


@dataclass
class AssignmentStats:
    assignment: str
    max_score: float
    scores: list[float] = field(default_factory=list)
    submitted: int = 0
    not_graded: int = 0
    late: int = 0
    #: seconds autograde spent on each submission (its last run, graded or not)
    elapsed: list[float] = field(default_factory=list)

    def bins(self) -> list[int]:
        """How many scores fall in each of :data:`BINS` equal parts of the points (the top one closed)."""
        counts = [0] * BINS
        for score in self.scores:
            fraction = score / self.max_score if self.max_score else 0.0
            counts[min(BINS - 1, int(fraction * BINS))] += 1
        return counts


@dataclass
class ClassReport:
    course_id: str
    assignments: list[AssignmentStats]
    checks: list[CheckStats]
    #: student -> [(assignment, what is missing)]
    missing: dict[str, list[tuple[str, str]]]
    #: student -> (score, max) over every assignment
    totals: dict[str, tuple[float, float]]
    made: str = ""

    @property
    def ungraded(self) -> list[str]:
        """Assignments nobody's submission is graded in yet (their checks are left out of the tables)."""
        return [a.assignment for a in self.assignments if not a.scores]

    @property
    def graded_checks(self) -> list[CheckStats]:
        return [c for c in self.checks if c.assignment not in self.ungraded]

    @property
    def grading_seconds(self) -> float:
        return sum(sum(a.elapsed) for a in self.assignments)


def build_report(course: Course, assignments: list[str]) -> ClassReport:
    results = class_results(course, assignments)
    stats = {a: AssignmentStats(a, 0.0) for a in assignments}
    checks: dict[tuple[str, str, str], CheckStats] = {}
    for assignment in assignments:  # every check of the source, in notebook order, even one nobody was graded on
        for notebook, grade_id, points, description in source_checks(course, assignment):
            checks[(assignment, notebook, grade_id)] = CheckStats(assignment, notebook, grade_id, description, points)
    missing: dict[str, list[tuple[str, str]]] = {}
    totals: dict[str, tuple[float, float]] = {}
    for result in results:
        entry = stats[result.assignment]
        entry.max_score = result.max_score
        score, most = totals.get(result.student, (0.0, 0.0))
        totals[result.student] = (score + (result.score or 0.0), most + result.max_score)
        if result.state != "not submitted":
            entry.submitted += 1
        # every last run counts, those that failed or timed out too; one stopped before it ended graded nothing
        if result.elapsed is not None and result.record_status != "interrupted":
            entry.elapsed.append(float(result.elapsed))
        if result.state == "graded":
            entry.scores.append(result.score or 0.0)
            entry.late += result.late
            _count_checks(result, checks)
            for notebook in result.notebooks_in("not submitted"):  # graded, but in part
                missing.setdefault(result.student, []).append((result.assignment, f"{notebook}.ipynb not submitted"))
            continue
        missing.setdefault(result.student, []).append((result.assignment, _why_missing(result)))
        entry.not_graded += result.state == "not graded"
    return ClassReport(course.course_id, list(stats.values()), list(checks.values()), missing, totals,
                       made=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def _count_checks(result: Result, checks: dict) -> None:
    for check in result.checks:
        key = (result.assignment, check.notebook, check.grade_id)
        stats = checks.setdefault(key, CheckStats(result.assignment, check.notebook, check.grade_id, "", 0.0))
        stats.max_points = max(stats.max_points, check.max_points)
        if check.points is None or not check.handed_in:  # a notebook not handed in is missing, not failed
            continue
        stats.graded += 1
        if check.passed:
            stats.passed += 1
        else:
            stats.failures[check.first_line] += 1


def _why_missing(result: Result) -> str:
    if result.state == "not submitted":
        return "not submitted"
    if result.record_status in ("failed", "timeout"):
        return f"submitted, grading {result.record_status}: {result.record_reason}".rstrip(": ")
    if result.interrupted:  # not a failure: the run was stopped while it graded this one
        return f"submitted, {INTERRUPTED}: {result.record_reason}".rstrip(": ")
    return "submitted, not graded yet"


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.0f}%"


def _seconds(total: float) -> str:
    minutes, seconds = divmod(round(total), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _bin_labels() -> list[str]:
    step = 100 // BINS
    return [f"{i * step}-{(i + 1) * step}%" for i in range(BINS)]


# -- the terminal ---------------------------------------------------------------------------------------------


def print_report(report: ClassReport, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"course {report.course_id}: scores")
    for column, justify in (("assignment", "left"), ("submitted", "right"), ("graded", "right"), ("late", "right"),
                            ("mean, median, range", "left"), ("students per fifth of the points", "left")):
        table.add_column(column, justify=justify, no_wrap=column == "assignment", overflow="fold")
    for a in report.assignments:
        scores = a.scores
        spread = (f"{statistics.mean(scores):.2f}, {statistics.median(scores):g}, {min(scores):g}-{max(scores):g}"
                  if scores else "-")
        table.add_row(a.assignment, str(a.submitted), str(len(scores)), str(a.late), spread,
                      f"{'·'.join(str(n) for n in a.bins())} of {a.max_score:g}")
    console.print(table)

    checks = Table(title="checks: pass rate and the most common failures", show_lines=True)
    for column in ("assignment", "check: what it checks", "points", "passed", "most common failures (first line)"):
        checks.add_column(column, overflow="fold", no_wrap=column in ("assignment", "points", "passed"))
    for c in report.graded_checks:
        failures = "\n".join(f"{n} x {escape(line)}" for line, n in c.failures.most_common(TOP_FAILURES))
        checks.add_row(c.assignment, c.label, f"{c.max_points:g}", f"{c.passed}/{c.graded} {_percent(c.rate)}",
                       failures, style="red" if c.rate is not None and c.rate < 0.5 else None)
    console.print(checks)
    if report.ungraded:
        console.print(f"no graded submission yet: {', '.join(report.ungraded)}")

    students = Table("student", "total", "missing", title="students", show_lines=True)
    for student, (score, most) in sorted(report.totals.items()):
        gaps = "\n".join(f"{a}: {escape(why)}" for a, why in report.missing.get(student, []))
        students.add_row(student, f"{score:g}/{most:g}", gaps or "nothing")
    console.print(students)

    times = Table("assignment", "submissions", "total", "mean", "slowest",
                  title="time spent grading (autograde's records: each submission's last run)")
    for a in report.assignments:
        if a.elapsed:
            times.add_row(a.assignment, str(len(a.elapsed)), _seconds(sum(a.elapsed)),
                          _seconds(statistics.mean(a.elapsed)), _seconds(max(a.elapsed)))
    times.add_row("all", str(sum(len(a.elapsed) for a in report.assignments)), _seconds(report.grading_seconds), "", "",
                  style="bold")
    console.print(times)


# -- the plots (matplotlib, as inline SVG) -------------------------------------------------------------------------


def _svg(figure) -> str:
    import io

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, selectable, small
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def score_plot(a: AssignmentStats) -> str:
    figure = _figure(4.8, 2.6)
    axes = figure.add_subplot()
    axes.bar(_bin_labels(), a.bins(), color="#4c72b0")
    axes.set_title(f"{a.assignment}: {len(a.scores)} graded, of {a.max_score:g} points")
    axes.set_xlabel("score, as a share of the points")
    axes.set_ylabel("students")
    axes.yaxis.get_major_locator().set_params(integer=True)
    return _svg(figure)


def pass_rate_plot(checks: list[CheckStats], assignment: str) -> str:
    rows = [c for c in checks if c.assignment == assignment]
    figure = _figure(6.4, 0.45 * len(rows) + 1.0)
    axes = figure.add_subplot()
    rates = [100 * (c.rate or 0.0) for c in rows]
    axes.barh([c.grade_id for c in rows], rates,
              color=["#c44e52" if c.rate is not None and c.rate < 0.5 else "#55a868" for c in rows])
    axes.invert_yaxis()
    axes.set_xlim(0, 100)
    axes.set_xlabel("submissions passing (%)")
    axes.set_title(f"{assignment}: pass rate per check")
    return _svg(figure)


def time_plot(assignments: list[AssignmentStats]) -> str:
    timed = [a for a in assignments if a.elapsed]
    figure = _figure(6.4, 0.5 * len(timed) + 1.2)
    axes = figure.add_subplot()
    for row, a in enumerate(timed):  # one dot per submission, the mean as a bar
        axes.barh(row, statistics.mean(a.elapsed), color="#dddddd")
        axes.scatter(a.elapsed, [row] * len(a.elapsed), color="#4c72b0", zorder=3)
    axes.set_yticks(range(len(timed)), [a.assignment for a in timed])
    axes.invert_yaxis()
    axes.set_xlabel("seconds to grade one submission (bar: the mean)")
    axes.set_title("time spent grading")
    return _svg(figure)


# -- the page -------------------------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0 2rem; }
th, td { border: 1px solid #ccc; padding: .3rem .6rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; white-space: nowrap; }
td.low { color: #a00; font-weight: bold; }
code { white-space: pre-wrap; overflow-wrap: anywhere; }
code.id { white-space: nowrap; }
figure { display: inline-block; margin: 0 1rem 1rem 0; }
figure svg { max-width: 100%; height: auto; }
"""


def _table(table_id: str, headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """An HTML table; cells are already escaped HTML."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{cell}</td>' if i in numeric else f"<td>{cell}</td>"
                         for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def html_page(report: ClassReport) -> str:
    e = html.escape
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>ddp-course report: "
             f"{e(report.course_id)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>Course {e(report.course_id)}</h1><p>made {e(report.made)} by <code>ddp-course report</code></p>",
             "<h2>Scores</h2>"]
    rows = []
    for a in report.assignments:
        s = a.scores
        rows.append([e(a.assignment), str(a.submitted), str(len(s)), str(a.not_graded), str(a.late),
                     f"{statistics.mean(s):.2f}" if s else "-", f"{statistics.median(s):g}" if s else "-",
                     f"{min(s):g}-{max(s):g}" if s else "-", f"{a.max_score:g}",
                     " · ".join(f"{label}: {n}" for label, n in zip(_bin_labels(), a.bins()))])
    parts.append(_table("assignments", ["assignment", "submitted", "graded", "not graded", "late", "mean", "median",
                                        "min-max", "points", "distribution"], rows, {1, 2, 3, 4, 5, 6, 7, 8}))
    parts += [f'<figure class="plot" data-plot="scores {e(a.assignment)}">{score_plot(a)}</figure>'
              for a in report.assignments if a.scores]

    parts.append("<h2>Checks</h2>")
    rows = []
    for c in report.graded_checks:
        failures = "<br>".join(f"{n} × <code>{e(line)}</code>" for line, n in c.failures.most_common(TOP_FAILURES))
        low = c.rate is not None and c.rate < 0.5
        rows.append([e(c.assignment), f'<code class="id">{e(c.grade_id)}</code>', as_html(c.description),
                     f"{c.max_points:g}",
                     f"{c.passed}/{c.graded}", f'<span class="{"low" if low else ""}">{_percent(c.rate)}</span>',
                     failures])
    parts.append(_table("checks", ["assignment", "check", "what it checks", "points", "passed", "pass rate",
                                   "most common failures (first line, count)"], rows, {3, 4, 5}))
    parts += [f'<figure class="plot" data-plot="pass rate {e(a.assignment)}">'
              f"{pass_rate_plot(report.checks, a.assignment)}</figure>"
              for a in report.assignments if any(c.graded for c in report.checks if c.assignment == a.assignment)]
    if report.ungraded:
        parts.append(f"<p>No graded submission yet: {e(', '.join(report.ungraded))}.</p>")

    parts.append("<h2>Students</h2>")
    rows = [[e(student), f"{score:g}/{most:g}",
             "<br>".join(f"{e(a)}: {e(why)}" for a, why in report.missing.get(student, [])) or "nothing"]
            for student, (score, most) in sorted(report.totals.items())]
    parts.append(_table("students", ["student", "total", "missing"], rows, {1}))

    parts.append("<h2>Time spent grading</h2>")
    rows = [[e(a.assignment), str(len(a.elapsed)), _seconds(sum(a.elapsed)), _seconds(statistics.mean(a.elapsed)),
             _seconds(max(a.elapsed))] for a in report.assignments if a.elapsed]
    rows.append(["all", str(sum(len(a.elapsed) for a in report.assignments)), _seconds(report.grading_seconds), "",
                 ""])
    parts.append(_table("grading-time", ["assignment", "submissions", "total", "mean", "slowest"], rows,
                        {1, 2, 3, 4}))
    if any(a.elapsed for a in report.assignments):
        parts.append(f'<figure class="plot" data-plot="grading time">{time_plot(report.assignments)}</figure>')
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(text: str, out: Path) -> None:
    """Write the page whole or not at all; one line naming the path and the cause when it cannot."""
    write_whole(out, text)


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The HTML page to write (default: report.html in the course directory).")
@course_dir_option
def command(assignments, html_out, course_dir):
    """The class at a glance: score distributions, each check's pass rate and most common failures, what each
    student is missing, time spent grading; on the terminal and as an HTML page with plots. Reads only."""
    from rich.console import Console

    course = Course.open(course_dir)
    out = html_out or course.root / "report.html"
    report = build_report(course, course.pick_assignments(assignments))
    write_page(html_page(report), out)  # first: a page that cannot be written is the one line said
    console = Console()
    print_report(report, console)
    console.print(f"wrote {out}")
