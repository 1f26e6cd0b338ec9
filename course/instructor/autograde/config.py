"""What the course's nbgrader config decides for a run, wherever it grades: how long one submission may
take (:func:`submission_timeout`) and how its notebooks are isolated (:func:`isolation_line`)."""

from __future__ import annotations

import nbformat

from course.instructor.coursedir import Course

#: what a submission may take beyond the sum of its cells' time limits (kernel start, nbgrader's own work)
STARTUP_MARGIN = 120.0


def submission_timeout(course: Course, assignment: str) -> float:
    """The most one submission may take: the sum of its cells' limits (Execute.timeout_func), each test
    cell once more for the verifier's re-run when the course verifies (VerifyTests), plus margins."""
    from course.grading.pipeline import VerifyTests
    from course.grading.verifier import STARTUP as VERIFIER_STARTUP

    execute = course.config.Execute
    timeout_func = execute.get("timeout_func")
    default = execute.get("timeout", 30) or 30
    verified = VerifyTests in autograde_steps(course)
    verify_limit = course.config.VerifyTests.get("cell_timeout", VerifyTests.cell_timeout.default_value)
    total = STARTUP_MARGIN + (VERIFIER_STARTUP if verified else 0.0)
    for path in course.folder("source", assignment=assignment).glob("*.ipynb"):
        for cell in nbformat.read(str(path), as_version=4).cells:
            if cell.cell_type == "code":
                limit = timeout_func(cell) if timeout_func else default
                total += limit if limit and limit > 0 else default
                meta = cell.metadata.get("nbgrader", {})
                if verified and meta.get("grade") and not meta.get("solution"):
                    total += verify_limit
    return total


def autograde_steps(course: Course) -> list:
    """The preprocessors nbgrader's autograde runs for this course."""
    from nbgrader.converters import Autograde

    return list(course.config.Autograde.get("autograde_preprocessors",
                                            Autograde.autograde_preprocessors.default_value))


def isolation_line(course: Course) -> str:
    """One line for the start of a run: how each notebook is isolated (course.sandbox), or that it is not."""
    from course.grading.execute import SandboxedExecute
    from course.sandbox import describe

    if SandboxedExecute in autograde_steps(course):
        return describe()
    return ("sandbox: none: this course's nbgrader_config.py runs notebooks unsandboxed and unverified "
            "(it predates ddp-course's sandbox; `ddp-course init --force` rewrites it)")
