"""``ddp-course lab``: JupyterLab on the course's notebooks."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from course.paths import course_root


def lab_argv(root: Path, port: int, ip: str, open_browser: bool, extra: tuple[str, ...]) -> list[str]:
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
    return argv + list(extra)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--dir", "root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder to open (default: the course's lessons and exercises).")
@click.option("--port", default=8888, show_default=True, help="Port for JupyterLab.")
@click.option("--ip", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 in a container).")
@click.option("--no-browser", is_flag=True, help="Do not open a browser.")
@click.option("--dry-run", is_flag=True, help="Print the command instead of running it.")
@click.argument("jupyter_args", nargs=-1, type=click.UNPROCESSED)
def command(root, port, ip, no_browser, dry_run, jupyter_args):
    """Start JupyterLab on the course's notebooks (extra arguments go to JupyterLab)."""
    root = (root or course_root()).resolve()
    if not root.is_dir():
        raise click.ClickException(f"{root} is not a folder")
    argv = lab_argv(root, port, ip, not no_browser, jupyter_args)
    if dry_run:
        click.echo(" ".join(argv))
        return
    if shutil.which("jupyter") is None and not _has_jupyterlab():
        raise click.ClickException("JupyterLab is not installed: pip install ddp-course (it depends on jupyterlab)")
    os.execv(argv[0], argv)


def _has_jupyterlab() -> bool:
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return False
    return True
