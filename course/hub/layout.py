"""The class folder: everything a class server keeps, each part reachable by exactly who needs it.

::

    <class>/                      root, 0755
      hub/                        root only (0700): the hub's database, its cookie secret, its config, the
                                  passwords of the accounts it made (passwords.csv), each account's uid and
                                  password hash (accounts.json: a container made anew makes them again as they were)
      edition/                    everyone may read: the course as students get it (lessons, student copies)
      course/                     the instructors' group only (2770): the nbgrader course (``ddp-course init``):
                                  exercise sources, gradebook, submissions, feedback
      exchange/<course_id>/       nbgrader's exchange (:mod:`course.hub.exchange`):
        outbound/                 released assignments: instructors write, everyone reads (2775)
        inbound/<student>/        one per student: its student and the instructors only (2770)
        feedback/                 feedback pages: instructors write, others may open a page they can name (2771)
      config/student/, config/instructor/
                                  each role's Jupyter settings (first on its servers' JUPYTER_CONFIG_PATH)

Students never reach ``hub/`` or ``course/`` (neither may they read the exercise sources the course was made
from: :func:`sources_exposed`), nor another student's inbound folder or home.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from course.errors import CourseError
from course.hub.exchange import INBOUND, factory_config_lines
from course.hub.roster import Member
from course.instructor.coursedir import write_whole
from course.student.labconfig import LAB_PLUGINS_OFF

DEFAULT_DIR = Path("/srv/ddp-course")
DEFAULT_GROUP = "ddp-instructors"

#: nbgrader's server extensions per role: students get the assignment list (fetch, submit, feedback) and
#: Validate; instructors everything but the course list (it asks the hub for nbgrader groups this hub has none of)
SERVER_EXTENSIONS = {
    "student": {
        "nbgrader.server_extensions.formgrader": False,
        "nbgrader.server_extensions.course_list": False,
        "nbgrader.server_extensions.assignment_list": True,
        "nbgrader.server_extensions.validate_assignment": True,
    },
    "instructor": {
        "nbgrader.server_extensions.formgrader": True,
        "nbgrader.server_extensions.course_list": False,
        "nbgrader.server_extensions.assignment_list": True,
        "nbgrader.server_extensions.validate_assignment": True,
    },
}
#: nbgrader's JupyterLab plugins each role does not see
LAB_PLUGINS_HIDDEN = {
    "student": ("formgrader", "create-assignment", "course-list"),
    "instructor": ("course-list",),
}


@dataclass(frozen=True)
class ClassDir:
    root: Path = DEFAULT_DIR
    course_id: str = "ddp-course"
    instructor_group: str = DEFAULT_GROUP
    #: whether each person is a Linux account here (one machine); False on Kubernetes, where every pod runs as
    #: one uid and the mounts keep students apart
    accounts: bool = True

    # ------------------------------------------------------------------ where things are
    @property
    def hub(self) -> Path:
        return self.root / "hub"

    @property
    def edition(self) -> Path:
        return self.root / "edition"

    @property
    def course(self) -> Path:
        return self.root / "course"

    @property
    def exchange(self) -> Path:
        return self.root / "exchange"

    @property
    def exchange_course(self) -> Path:
        return self.exchange / self.course_id

    def inbound(self, student: str) -> Path:
        return self.exchange_course / INBOUND / student

    def config(self, role: str) -> Path:
        return self.root / "config" / role

    @property
    def passwords(self) -> Path:
        return self.hub / "passwords.csv"

    @property
    def roles(self) -> Path:
        """username -> role, for the progress service (root only)"""
        return self.hub / "roles.json"

    @property
    def saved_accounts(self) -> Path:
        return self.hub / "accounts.json"

    @property
    def cookie_secret(self) -> Path:
        return self.hub / "jupyterhub_cookie_secret"

    @property
    def hub_config(self) -> Path:
        return self.hub / "jupyterhub_config.py"

    # ------------------------------------------------------------------ making it
    def make_private_parts(self) -> None:
        """The class folder, the hub's own folder and its cookie secret (made once, never rewritten)."""
        self.root.mkdir(parents=True, exist_ok=True)
        _own(self.root, 0, 0, 0o755)
        self.hub.mkdir(exist_ok=True)
        _own(self.hub, 0, 0, 0o700)
        if not self.cookie_secret.exists():
            fd = os.open(self.cookie_secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32) + "\n")

    def make_exchange(self, members: list[Member]) -> None:
        """The exchange: outbound and feedback for instructors to write, one inbound folder per member."""
        gid = grp.getgrnam(self.instructor_group).gr_gid
        self.exchange.mkdir(exist_ok=True)
        _own(self.exchange, 0, 0, 0o755)
        self.exchange_course.mkdir(exist_ok=True)
        _own(self.exchange_course, 0, gid, 0o2775)
        for name, mode in (("outbound", 0o2775), (INBOUND, 0o2751), ("feedback", 0o2771)):
            (self.exchange_course / name).mkdir(exist_ok=True)
            _own(self.exchange_course / name, 0, gid, mode)
        for member in members:
            folder = self.inbound(member.username)
            folder.mkdir(exist_ok=True)
            _own(folder, pwd.getpwnam(member.username).pw_uid, gid, 0o2770, follow=False)

    def make_course(self, exercises: Path | None) -> list[tuple[str, str]]:
        """The instructors' nbgrader course (``ddp-course init``), shared by their group and closed to others."""
        from course.instructor.init import init_course

        report = init_course(self.course, exercises=exercises, course_id=self.course_id)
        gid = grp.getgrnam(self.instructor_group).gr_gid
        for path in [self.course, *self.course.rglob("*")]:
            if path.is_symlink():
                continue
            st = path.stat()
            mode = (stat.S_IMODE(st.st_mode) | 0o060 | (0o2010 if path.is_dir() else 0)) & ~0o007
            _own(path, st.st_uid, gid, mode)
        return report

    def make_edition(self, course_root: Path) -> list[str]:
        """The course as students get it: the lessons and the student copies of the exercises (workspaces take
        the lessons from it, ``ddp-course check`` the copies its locked cells come back from); returns the
        problems found."""
        from course.student import workspace

        report = workspace.sync(self.edition, Path(course_root))
        for path in [self.edition, *self.edition.rglob("*")]:
            if not path.is_symlink():
                _own(path, 0, 0, 0o755 if path.is_dir() else 0o644)
        return list(report.problems)

    def write_role_configs(self) -> None:
        """Each role's Jupyter settings: the nbgrader extensions and plugins it gets, its nbgrader config."""
        for role in ("student", "instructor"):
            folder = self.config(role)
            (folder / "labconfig").mkdir(parents=True, exist_ok=True)
            server = {"ServerApp": {"jpserver_extensions": SERVER_EXTENSIONS[role]}}
            write_whole(folder / "jupyter_server_config.json", json.dumps(server, indent=1) + "\n")
            hidden = [f"@jupyter/nbgrader:{name}" for name in LAB_PLUGINS_HIDDEN[role]] + list(LAB_PLUGINS_OFF)
            page = {"disabledExtensions": {name: True for name in hidden}}
            write_whole(folder / "labconfig" / "page_config.json", json.dumps(page, indent=1) + "\n")
            write_whole(folder / "nbgrader_config.py", self.nbgrader_config(role))
            for path in [folder.parent, folder, *folder.rglob("*")]:
                _own(path, 0, 0, 0o755 if path.is_dir() else 0o644)

    def nbgrader_config(self, role: str) -> str:
        lines = [
            f"# nbgrader settings of a ddp-course class server, {role}s (written by `ddp-course hub start`).",
            "c = get_config()  # noqa: F821",
            f"c.CourseDirectory.course_id = {self.course_id!r}",
            f"c.Exchange.root = {str(self.exchange)!r}",
            *factory_config_lines(),
        ]
        if role == "instructor" and not self.accounts:
            lines += ["# every pod runs as one uid: a student's pod mounts only their own inbound folder",
                      "c.ExchangeCollect.owner_is_student = False"]
        if role == "instructor":
            lines += [f"c.CourseDirectory.root = {str(self.course)!r}",
                      "# instructors share the course and the exchange through their group",
                      "c.CourseDirectory.groupshared = True"]
        return "\n".join(lines) + "\n"


def _own(path: Path, uid: int, gid: int, mode: int, follow: bool = True) -> None:
    if not follow and path.is_symlink():
        raise CourseError(f"{path} is a symbolic link: the class folder's own folders must be real folders")
    os.chown(path, uid, gid, follow_symlinks=follow)
    os.chmod(path, mode)


def sources_exposed(course_root: Path) -> list[str]:
    """The exercise source files (solutions, hidden tests) that a user who is not root can read; a class server
    refuses to start while there is one (its students are users of this machine)."""
    exercises = Path(course_root) / "exercises"
    if not exercises.is_dir():
        return []
    return [str(path) for path in sorted(exercises.rglob("*")) if path.is_file() and others_can_read(path)]


def others_can_read(path: Path) -> bool:
    """Whether a user who is neither its owner nor in its group can read the file ``path``: every folder above it
    enterable by them and the file readable by them."""
    path = Path(path).resolve()
    for above in reversed(path.parents):
        if not os.stat(above).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)
