"""``ddp-course lab``: JupyterLab on the student's own workspace.

Each start makes or updates the workspace (:mod:`course.student.workspace`: the lessons and the
student copies of the exercises, never the sources; a notebook the student changed is never
overwritten), writes the lab's settings (:mod:`course.student.labconfig`: no instructor tools),
says which notebooks are broken, then replaces itself with JupyterLab.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from course.errors import CourseError, PartlyDone


def lab_argv(root: Path, port: int, ip: str, open_browser: bool, extra: tuple[str, ...],
             allow_root: bool = False) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={root}",
        f"--ServerApp.port={port}",
        f"--ServerApp.ip={ip}",
    ]
    if not open_browser:
        argv.append("--no-browser")
    if allow_root and "--allow-root" not in extra:
        argv.append("--allow-root")
    return argv + list(extra)


def installed_course() -> Path:
    """The course a workspace is made from: the checkout, or ``DDP_COURSE_ROOT`` (the lab image's)."""
    from course.paths import course_root

    course = course_root()
    if not any((course / folder).is_dir() for folder in ("lessons", "exercises")):
        raise CourseError(f"no course at {course} (no lessons/ or exercises/): set DDP_COURSE_ROOT to the folder "
                          "that holds them")
    return course


def root_allowed(allow_root: bool) -> bool:
    """Whether JupyterLab gets --allow-root; raises a one-line CourseError for root outside a container."""
    from course.student.labconfig import in_container, is_root

    if not is_root():
        return False
    if allow_root or in_container():
        return True
    raise CourseError("you are root outside a container, where JupyterLab refuses to run: start `ddp-course lab` "
                      "as your own user, or add --allow-root to run it as root anyway")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--dir", "folder", type=click.Path(path_type=Path), default=None,
              help="Your workspace folder (default: $DDP_COURSE_WORKSPACE, the current folder if it is a "
                   "workspace, else ~/ddp-course-work). Made on first start, kept up to date after.")
@click.option("--port", default=8888, show_default=True, help="Port for JupyterLab.")
@click.option("--ip", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 in a container).")
@click.option("--no-browser", is_flag=True, help="Do not open a browser.")
@click.option("--allow-root", is_flag=True, help="Run as root outside a container (inside one it is allowed anyway).")
@click.option("--make-only", is_flag=True, help="Make or update the workspace, do not start JupyterLab.")
@click.option("--dry-run", is_flag=True, help="Print the command instead of running it; write nothing.")
@click.argument("jupyter_args", nargs=-1, type=click.UNPROCESSED)
def command(folder, port, ip, no_browser, allow_root, make_only, dry_run, jupyter_args):
    """Start JupyterLab on your workspace: the lessons and the exercises, your own copies (extra arguments go to
    JupyterLab).

    Your changes are kept across course updates: a notebook you changed is never overwritten (a newer
    version from the course goes beside it as NAME.updated.ipynb); delete a notebook to get a fresh copy.
    """
    from course.student import labconfig, workspace

    course = installed_course()
    ws = workspace.check_folder(folder if folder is not None else workspace.default_workspace(), course)
    allowed = False if make_only else root_allowed(allow_root or "--allow-root" in jupyter_args)
    config_dir = ws / labconfig.CONFIG_DIR
    argv = lab_argv(ws, port, ip, not no_browser, jupyter_args, allow_root=allowed)
    env = lab_env(config_dir)
    if dry_run:
        click.echo(f"JUPYTER_CONFIG_PATH={env['JUPYTER_CONFIG_PATH']} " + " ".join(argv))
        return
    try:
        report = workspace.sync(ws, course)
    except OSError as err:  # a folder inside it that is not ours, a full disk: one line
        raise CourseError(f"cannot write your workspace {ws}: {err.strerror or err} ({err.filename}); choose "
                          "another folder with --dir") from None
    for line in report.lines():
        click.echo(line)
    for line in workspace.broken_notebooks(ws):
        click.echo(f"warning: {line}", err=True)
    if report.problems:  # nothing of a solution reaches a student's lab, and the lab does not start without saying so
        raise PartlyDone(f"{len(report.problems)} course file(s) not installed (listed above)"
                         + ("" if make_only else f": JupyterLab was not started. Remove them from {course} (or ask "
                            "whoever installed the course), then start again"))
    if make_only:
        return
    labconfig.write(ws)
    if not _has_jupyterlab():
        raise CourseError("JupyterLab is not installed: pip install ddp-course (it depends on jupyterlab)")
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


def lab_env(config_dir: Path) -> dict[str, str]:
    """This environment with the lab's settings first on JUPYTER_CONFIG_PATH: they win over the Python
    environment's (nbgrader enables its instructor tools there), the student's own ~/.jupyter still comes first."""
    paths = [str(config_dir), *filter(None, os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep))]
    return {**os.environ, "JUPYTER_CONFIG_PATH": os.pathsep.join(dict.fromkeys(paths))}


def _has_jupyterlab() -> bool:
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return False
    return True
