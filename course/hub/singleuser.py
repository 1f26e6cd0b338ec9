"""What each person's server runs first on the class server, as them: ``python -m course.hub.singleuser``.

The hub starts it as the person's own Linux user (JupyterHub's local spawner), with their role in the
environment (:data:`ROLE_ENV`, set by the hub from the roster). A student gets their workspace (the lessons,
made from the class's edition as ``ddp-course lab`` makes one, their changes kept across updates; assignments
arrive in it through nbgrader's Assignments list) and kernels that record their progress
(:mod:`course.progress`); an instructor gets the class's nbgrader course, with files their group shares.
Then it becomes JupyterHub's single-user server on that folder, each role's Jupyter settings first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROLE_ENV = "DDP_COURSE_HUB_ROLE"
CLASS_ENV = "DDP_COURSE_HUB_DIR"
#: a student's workspace, in their home
WORKSPACE_NAME = "ddp-course-work"

KERNEL_CONFIG = '''\
# Written by the ddp-course class server at each start of your server: your kernels note your progress
# (lessons run to the end, the last result of each check, hints asked; course/progress.py).
c = get_config()  # noqa: F821
c.InteractiveShellApp.extensions = ["course.progress"]
'''


def student_setup(class_dir: Path, home: Path, env: dict[str, str]) -> Path:
    """Make or update the student's workspace from the class's edition and turn on progress; returns it."""
    from course.progress import PROGRESS_ENV, RECORD_PARTS, WORKSPACE_ENV
    from course.student import workspace

    edition = class_dir / "edition"
    ws = workspace.check_folder(home / WORKSPACE_NAME, edition)
    report = workspace.sync(ws, edition, only=("lessons",))  # assignments come through the exchange
    for line in report.lines():
        print(f"[ddp-course] {line}", flush=True)
    ipython = home / ".ddp-course" / "ipython"
    profile = ipython / "profile_default"
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text(KERNEL_CONFIG)
    env.update({"IPYTHONDIR": str(ipython), PROGRESS_ENV: str(home.joinpath(*RECORD_PARTS)),
                WORKSPACE_ENV: str(ws), "DDP_COURSE_ROOT": str(edition)})
    return ws


def main(argv: list[str]) -> None:
    role = os.environ.get(ROLE_ENV, "student")
    class_dir = Path(os.environ[CLASS_ENV])
    home = Path(os.path.expanduser("~"))
    env = dict(os.environ)
    if role == "instructor":
        os.umask(0o002)  # the course and the exchange are shared by the instructors' group
        root = class_dir / "course"
    else:
        os.umask(0o077)
        root = student_setup(class_dir, home, env)
    config = str(class_dir / "config" / ("instructor" if role == "instructor" else "student"))
    paths = [config, *filter(None, env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep))]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.chdir(root)
    args = [sys.executable, "-m", "jupyterhub.singleuser", f"--ServerApp.root_dir={root}", *argv]
    sys.stdout.flush()
    os.execve(args[0], args, env)


if __name__ == "__main__":  # pragma: no cover - the hub starts it
    main(sys.argv[1:])
