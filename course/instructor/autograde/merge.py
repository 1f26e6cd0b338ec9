"""One ended submission into the course: install what its scratch course graded, or record why it was not
graded; its summary row. Only the process that holds the course lock calls :func:`finish` (a local run as
each worker ends, a Slurm or Kubernetes run as it collects the outcomes its tasks wrote)."""

from __future__ import annotations

import shutil

from course.instructor.autograde.records import Row, Submission, fill_scores, record_interrupted, write_record
from course.instructor.autograde.scratch import install_results, scratch_course
from course.instructor.coursedir import Course

#: failures nbgrader reports with a misleading or cryptic line, and what they mean
KNOWN_FAILURES = (
    ("Timeout waiting for IOPub output", "a cell ran past its time limit and ignored the interrupt, "
     "so nbgrader gave up on the notebook (see the log for the cell)"),
    ("UnresponsiveKernelError", "the kernel stopped answering (an endless loop that ignores interrupts?)"),
    ("DeadKernelError", "the kernel died (out of memory, or the student's code exited the process)"),
)


def short_reason(result: dict) -> str:
    """The most telling line of a failed nbgrader run (its last exception line)."""
    text = "\n".join(filter(None, [result.get("log", ""), result.get("error", "")]))
    for marker, meaning in KNOWN_FAILURES:
        if marker in text:
            return meaning
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and "NbGraderException" not in line and not line.startswith("File "):
            return line[:300]
    return lines[-1][:300] if lines else "nbgrader failed without a message"


def finish(course: Course, outcome, scratch: Course | None = None, isolation: str = "") -> Row:
    """Install or record one ended submission (graded in ``scratch``, default its scratch course, under the
    sandbox ``isolation`` describes); its summary row."""
    submission: Submission = outcome.task
    scratch = scratch or scratch_course(course, submission)
    try:
        if outcome.kind == "done" and outcome.result.get("success"):
            install_results(course, scratch, submission)
            write_record(course, submission, "graded", outcome.elapsed, log=outcome.result.get("log", ""),
                         isolation=isolation)
            return fill_scores(course, Row(submission, "graded", outcome.elapsed))
        if outcome.kind == "done":
            reason = short_reason(outcome.result)
            log = (outcome.result.get("log") or "") + "\n" + (outcome.result.get("error") or "")
            write_record(course, submission, "failed", outcome.elapsed, reason, log, isolation=isolation)
            return Row(submission, "failed", outcome.elapsed, reason)
        if outcome.kind == "interrupted":  # a stop signal killed its worker: not graded, not the student's failure
            return record_interrupted(course, submission, outcome.elapsed, f"{outcome.detail}: rerun to grade it")
        status = "timeout" if outcome.kind == "timeout" else "failed"
        write_record(course, submission, status, outcome.elapsed, outcome.detail, isolation=isolation)
        return Row(submission, status, outcome.elapsed, outcome.detail)
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)
