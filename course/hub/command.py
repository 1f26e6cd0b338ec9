"""``ddp-course hub start --roster ROSTER``: a class on this machine, behind JupyterHub.

Run as root. Each start (the first makes, later ones bring up to date; nothing a person made is removed):

1. reads the roster (:mod:`course.hub.roster`) and refuses to go on where students could read what they must
   not: exercise sources readable by other users of this machine, or a Python they cannot run;
2. makes the accounts the machine lacks (their passwords listed in ``<class>/hub/passwords.csv``, root only),
   and the class folder (:mod:`course.hub.layout`): the lessons' edition, the instructors' nbgrader course,
   the exchange with an inbound folder per student, each role's Jupyter settings;
3. writes the hub's configuration (:mod:`course.hub.hubconfig`) and becomes JupyterHub (``--prepare-only``
   stops before).

Instructors then work in their own lab (the course folder: ``ddp-course release``, ``nbgrader
release_assignment``, ``nbgrader collect``, ``ddp-course autograde``, ``ddp-course feedback``, ``nbgrader
release_feedback``, or the same from the formgrader); students fetch and submit from the lab's Assignments list.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import click

from course.errors import CourseError
from course.hub.hubconfig import Ports, render
from course.hub.layout import DEFAULT_DIR, DEFAULT_GROUP, ClassDir, sources_exposed
from course.hub.roster import ensure_accounts, read_roster
from course.instructor.coursedir import write_whole


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable_python() -> list[str]:
    """Folders above this Python (or the course's code) that other users cannot enter: the hub's users could
    not start their servers."""
    from course.sandbox.box import python_paths
    from course.sandbox.linux import blocking_ancestor

    return sorted({folder for path in python_paths() if (folder := blocking_ancestor(path))})


def requirements(culler: bool = True) -> list[str]:
    missing = []
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        missing.append("JupyterHub (pip install 'ddp-course[hub]')")
    if culler:
        try:
            import jupyterhub_idle_culler  # noqa: F401
        except ImportError:
            missing.append("jupyterhub-idle-culler (pip install 'ddp-course[hub]', or --cull-idle-after 0)")
    if shutil.which("configurable-http-proxy") is None:
        missing.append("configurable-http-proxy (npm install -g configurable-http-proxy)")
    return missing


def prepare(roster: Path, folder: Path, course_root: Path, course_id: str, group: str, ip: str,
            ports: Ports, idle_minutes: int = 0, ssl: tuple[str, str] | None = None) -> tuple[ClassDir, list[str]]:
    """Everything before the hub starts; returns the class folder and lines to show."""
    if os.geteuid() != 0:
        raise CourseError("`ddp-course hub start` runs as root: the hub starts each person's server as their own "
                          "Linux user")
    members = read_roster(roster)
    from course.paths import CHECKOUT

    exposed = sources_exposed(course_root) + (sources_exposed(CHECKOUT) if Path(CHECKOUT) != Path(course_root) else [])
    if exposed:
        folder_list = "\n".join(f"  {p}" for p in exposed[:5]) + ("\n  ..." if len(exposed) > 5 else "")
        raise CourseError(f"other users of this machine can read the exercise sources (solutions, hidden tests), "
                          f"and your students will be users of this machine:\n{folder_list}\nclose them first: "
                          "chmod -R o-rwx on each exercises/ folder named (an instructor's checkout of the course, installed with "
                          "pip install -e, is one: or install the course without -e)")
    blocked = unreachable_python()
    if blocked:
        raise CourseError("your students could not run this Python: other users cannot enter "
                          + ", ".join(blocked) + " (make them enterable, chmod o+x, or install the course "
                          "where everyone can run it, e.g. a virtual environment under /opt)")
    classdir = ClassDir(Path(folder).resolve(), course_id=course_id, instructor_group=group)
    classdir.make_private_parts()
    accounts = ensure_accounts(members, group, classdir.passwords, classdir.saved_accounts)
    problems = classdir.make_edition(course_root)
    if problems:
        raise CourseError("these course files cannot reach students (nothing was started):\n"
                          + "\n".join(f"  {p}" for p in problems))
    classdir.make_course(Path(course_root) / "exercises")
    classdir.make_exchange(members)
    classdir.write_role_configs()
    write_whole(classdir.roles, json.dumps({m.username: m.role for m in members}, indent=1), mode=0o600)
    write_whole(classdir.hub_config, render(classdir, members, ip, ports, idle_minutes, ssl), mode=0o600)
    students = sum(not m.instructor for m in members)
    lines = [f"class folder: {classdir.root} ({students} students, {len(members) - students} instructors)",
             f"accounts made: {len(accounts.made)} (passwords in {classdir.passwords}, readable by root only); "
             f"kept: {len(accounts.kept)}; made again as they were: {len(accounts.restored)}"]
    return classdir, lines


@click.group()
def command():
    """A class on this machine: JupyterHub, the students' workspaces, nbgrader's exchange, their progress."""


@command.command()
@click.option("--roster", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="CSV of the class: username,role[,name] (role: student or instructor).")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIR,
              show_default=True, help="The class folder (made on the first start, kept after).")
@click.option("--ip", default="127.0.0.1", show_default=True, help="Address the hub listens on.")
@click.option("--port", default=8000, show_default=True, help="Port the hub listens on.")
@click.option("--course-id", default="ddp-course", show_default=True, help="nbgrader course id.")
@click.option("--instructor-group", default=DEFAULT_GROUP, show_default=True,
              help="Linux group of the instructors (made when missing).")
@click.option("--cull-idle-after", "idle_minutes", default=60, show_default=True, type=click.IntRange(min=0),
              help="Stop a server idle this many minutes (jupyterhub-idle-culler; 0: never). Work stays in the home.")
@click.option("--ssl-cert", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Serve HTTPS with this certificate (PEM; with --ssl-key).")
@click.option("--ssl-key", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="The certificate's private key (PEM).")
@click.option("--prepare-only", is_flag=True, help="Make everything, write the hub's config, do not start it.")
def start(roster, folder, ip, port, course_id, instructor_group, idle_minutes, ssl_cert, ssl_key, prepare_only):
    """Make the class (accounts, folders, settings) and start JupyterHub for it."""
    from course.paths import course_root

    if (ssl_cert is None) != (ssl_key is None):
        raise CourseError("HTTPS needs both --ssl-cert and --ssl-key")
    ssl = (str(ssl_cert.resolve()), str(ssl_key.resolve())) if ssl_cert else None
    missing = requirements(idle_minutes > 0)
    if missing and not prepare_only:
        raise CourseError("the class server needs " + " and ".join(missing))
    ports = Ports(public=port, hub=free_port(), proxy_api=free_port(), service=free_port())
    classdir, lines = prepare(roster, folder, course_root(), course_id, instructor_group, ip, ports, idle_minutes, ssl)
    for line in lines:
        click.echo(line)
    click.echo(f"hub: {'https' if ssl else 'http'}://{ip}:{port}/ (config {classdir.hub_config})")
    if prepare_only:
        return
    sys.stdout.flush()
    os.chdir(classdir.hub)
    argv = [sys.executable, "-m", "jupyterhub", "-f", str(classdir.hub_config)]
    os.execv(argv[0], argv)


@command.command("image-setup")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where the class folder goes in the image.")
@click.option("--course-id", default="ddp-course", show_default=True, help="nbgrader course id.")
@click.option("--kubernetes", is_flag=True, help="For pods that all run as one uid (collect by inbound folder).")
def image_setup(folder, course_id, kubernetes):
    """Build the parts of a class folder an image holds: the lessons' edition and each role's settings."""
    from course.paths import course_root

    classdir = ClassDir(Path(folder).resolve(), course_id=course_id, accounts=not kubernetes)
    classdir.root.mkdir(parents=True, exist_ok=True)
    problems = classdir.make_edition(course_root())
    if problems:
        raise CourseError("these course files cannot reach students:\n" + "\n".join(f"  {p}" for p in problems))
    classdir.write_role_configs()
    click.echo(f"class folder for an image: {classdir.root} (edition, config)")


@command.command("helm-values")
@click.option("--roster", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="CSV of the class: username,role[,name].")
@click.option("--image", required=True, help="The hub image (docker/Dockerfile, --target hub), NAME:TAG.")
@click.option("--course-id", default="ddp-course", show_default=True, help="nbgrader course id.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File to write (default: print).")
def helm_values(roster, image, course_id, output):
    """Zero to JupyterHub's values for this class, on Kubernetes (course/hub/kubernetes.py)."""
    from course.hub.kubernetes import render as render_values

    text = render_values(read_roster(roster), image, course_id)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_whole(output, text)
        click.echo(f"wrote {output}")
