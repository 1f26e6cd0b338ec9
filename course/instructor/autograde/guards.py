"""What keeps a run whole when it is stopped: one run per course, SIGTERM as Ctrl-C, and blocks a signal
waits for (a result is never half installed). A local run, a Slurm run, a Kubernetes collect and an array
task all use these."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from course.errors import CourseError
from course.instructor.coursedir import Course


@contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler):
    """``handler`` for ``signals`` during the block, then the previous ones (none set off the main thread)."""
    try:
        previous = {sig: signal.signal(sig, handler) for sig in signals}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM behaves like Ctrl-C, so a killed run cleans up its workers the same way."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    with _handling((signal.SIGTERM,), handler):
        yield


@contextmanager
def course_lock(course: Course):
    """One autograde at a time per course (they share the scratch space); released even on SIGKILL."""
    import fcntl

    course.state_dir.mkdir(parents=True, exist_ok=True)
    with open(course.state_dir / "autograde.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise CourseError(
                f"another ddp-course autograde is running in {course.root} (pid {fh.read().strip() or '?'})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


@contextmanager
def ignored_interrupts():
    """Ignore Ctrl-C/SIGTERM during the block: a run already stopping finishes its records (a second Ctrl-C, or the
    SIGTERM a service manager sends after a SIGINT, would cut them short)."""
    with _handling((signal.SIGINT, signal.SIGTERM), lambda signum, frame: None):
        yield


@contextmanager
def deferred_interrupts():
    """Hold Ctrl-C/SIGTERM until the block ends, so a result is never half installed."""
    caught = []

    def hold(signum, frame):
        caught.append(signum)

    try:
        with _handling((signal.SIGINT, signal.SIGTERM), hold):
            yield
    finally:
        if caught:
            raise KeyboardInterrupt
