"""The command-line options shared by the verbs that run one exercise notebook (``grade``, ``check``)."""

from __future__ import annotations

from pathlib import Path

import click

from course.grading.cells import Timeouts


def notebook_run_options(*, json_help: str, exercises_help: str):
    """Decorator: NOTEBOOK, ``--json``, ``--exercises``, ``--test-timeout`` and ``--timeout``, in that order."""

    def decorate(command):
        for option in reversed([
            click.argument("notebook", type=click.Path(dir_okay=False, path_type=Path)),
            click.option("--json", "as_json", is_flag=True, help=json_help),
            click.option("--exercises", type=click.Path(file_okay=False, path_type=Path), default=None,
                         help=exercises_help),
            click.option("--test-timeout", type=float, default=Timeouts.test, show_default=True,
                         help="Seconds each test cell may run (they run multi-rank jobs)."),
            click.option("--timeout", type=float, default=Timeouts.other, show_default=True,
                         help="Seconds an answer cell or a cell the student added may run (the course's own code cells get the test cells' limit)."),
        ]):
            command = option(command)
        return command

    return decorate
