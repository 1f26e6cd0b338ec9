"""Sections for the end of the test report (lesson times, the adversarial table) that survive pytest-xdist.

A test or fixture on any worker calls :func:`add`; at the end of its session a worker hands its sections
to the controller (xdist's ``workeroutput``), which prints every section in its terminal summary.
Without xdist the same sections are printed by this process.
"""

from __future__ import annotations

from collections.abc import Callable

KEY = "ddp_course_sections"

#: (title, lines), in the order they were added
sections: list[tuple[str, list[str]]] = []
#: called once at the end of the session, before the sections leave a worker (for sections built last)
finishers: list[Callable[[], None]] = []


def add(title: str, lines: list[str]) -> None:
    sections.append((title, list(lines)))


def at_session_end(build: Callable[[], None]) -> None:
    """Run ``build`` once at the end of the session (it calls :func:`add` with what the session measured)."""
    finishers.append(build)


def finish() -> None:
    while finishers:
        finishers.pop(0)()


def received(workeroutput: dict) -> None:
    sections.extend((title, list(lines)) for title, lines in workeroutput.get(KEY, []))
