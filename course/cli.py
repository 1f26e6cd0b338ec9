"""The ``ddp-course`` command line: a thin layer over the course's modules.

Each verb lives in its own module and is imported only when used, so
``ddp-course --help`` stays fast (no torch import).
"""

from __future__ import annotations

import importlib
import sys

import click

from course import __version__

#: verb -> "module:attribute" of a click command. One module per verb.
COMMANDS = {
    "lab": "course.lab:command",
    "grade": "course.grading.grade:command",
    "check": "course.student.check:command",
    "init": "course.instructor.init:command",
    "release": "course.instructor.release:command",
    "collect": "course.instructor.collect:command",
    "autograde": "course.instructor.autograde:command",
    "k8s-job": "course.instructor.autograde.k8s:command",
    "feedback": "course.instructor.feedback:command",
    "export": "course.instructor.export:command",
    "status": "course.instructor.status:command",
    "report": "course.instructor.report:command",
    "duedate": "course.instructor.duedate:command",
    "demo": "course.instructor.demo:command",
    "hub": "course.hub.command:command",
}


def skip_iri_grammar() -> None:
    """Do not build the RFC 3987 grammar that jsonschema's optional "iri" format check compiles on import.

    nbformat and nbgrader import jsonschema, which imports ``rfc3987_syntax`` when it is installed (jupyter-events
    pulls it in); that module compiles an Earley parser for RFC 3987 at import: 2.5 s of every instructor verb on
    a 2-core machine, for a format no notebook or gradebook schema uses. Marking it absent makes jsonschema skip
    that one format check in this process (it handles the ImportError itself). Not for ``lab``: the Jupyter
    server validates its events with jsonschema and keeps every check it has.
    """
    sys.modules.setdefault("rfc3987_syntax", None)


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use.

    The library raises the project's own errors (:class:`course.errors.CourseError`); this is
    the one place they become click errors: one line on stderr, no traceback. Exit status (every verb):
    0 all done; 1 nothing done, a usage or input error; 2 done in part, what was not done is listed
    (:class:`course.errors.PartlyDone`).
    """

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            err.exit_code = 1  # course.errors.EXIT_ERROR: 2 means "done in part" here
            raise

    def invoke(self, ctx):
        from course.errors import CourseError

        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            err.exit_code = 1
            raise
        except CourseError as err:
            error = click.ClickException(str(err))
            error.exit_code = err.exit_code
            raise error from None

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        if name != "lab":
            skip_iri_grammar()
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            # Keep `ddp-course --help` and the other verbs working; say what is missing.
            problem = f"{type(exc).__name__}: {exc}"

            @click.command(name=name, help=f"(unavailable: {problem})")
            def unavailable():
                raise click.ClickException(f"`ddp-course {name}` cannot load: {problem}. Reinstall with pip install -e .")

            return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddp-course")
def main() -> None:
    """ddp-course: learn PyTorch distributed training by running it.

    Lessons and exercises run real multi-process jobs (gloo on a CPU, nccl on GPUs);
    exercises are autograded on nbgrader.

    Exit status of every verb: 0 all done; 1 nothing done (a usage or input error, said in one line);
    2 done in part (what was not done is listed: files not filed, submissions not graded).
    """


if __name__ == "__main__":  # pragma: no cover
    main()
