"""The student lab's own Jupyter settings: no instructor tools, an nbgrader config, and what to do as root.

``ddp-course lab`` puts :data:`CONFIG_DIR` (inside the workspace) first on ``JUPYTER_CONFIG_PATH``,
so these settings win over the Python environment's (nbgrader's install enables every one of its
extensions there) and apply to this lab only: an instructor's own ``jupyter lab`` keeps formgrader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: the lab's Jupyter config folder, inside the workspace (hidden: the file browser does not list it)
CONFIG_DIR = Path(".ddp-course") / "jupyter"

#: nbgrader's server extensions: the instructor's off; Validate stays (it runs a notebook's own
#: tests in a kernel and needs no gradebook); the assignment list needs an exchange students lack
SERVER_EXTENSIONS = {
    "nbgrader.server_extensions.formgrader": False,
    "nbgrader.server_extensions.course_list": False,
    "nbgrader.server_extensions.assignment_list": False,
    "nbgrader.server_extensions.validate_assignment": True,
}
#: nbgrader's JupyterLab plugins that students must not see (its Validate button stays)
INSTRUCTOR_PLUGINS = ("formgrader", "create-assignment", "course-list", "assignment-list", "menu")

NBGRADER_CONFIG = '''\
# nbgrader settings of a ddp-course student workspace (written by `ddp-course lab`; rewritten at each start).
# A student has no gradebook and no exchange: only Validate is on, and it needs nothing here.
c = get_config()  # noqa: F821
'''


#: JupyterLab's own plugins the lab turns off: the news and update check, which greets a student with "Would you
#: like to get notified about official Jupyter news?" and would fetch from outside (a lab may run with no network)
LAB_PLUGINS_OFF = ("@jupyterlab/apputils-extension:announcements",)


def disabled_plugins() -> list[str]:
    return [f"@jupyter/nbgrader:{name}" for name in INSTRUCTOR_PLUGINS] + list(LAB_PLUGINS_OFF)


def write(workspace: Path) -> Path:
    """Write the lab's config folder in ``workspace``; returns it (first on the lab's ``JUPYTER_CONFIG_PATH``)."""
    folder = Path(workspace) / CONFIG_DIR
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    server = {"ServerApp": {"jpserver_extensions": SERVER_EXTENSIONS}}
    (folder / "jupyter_server_config.json").write_text(json.dumps(server, indent=1) + "\n")
    page = {"disabledExtensions": {name: True for name in disabled_plugins()}}
    (folder / "labconfig" / "page_config.json").write_text(json.dumps(page, indent=1) + "\n")
    (folder / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    return folder


def in_container() -> bool:
    """Whether this process runs in a container (Docker, Podman, Kubernetes, LXC), where root is the rule."""
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists() or os.environ.get("container"):
        return True
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(word in cgroup for word in ("docker", "kubepods", "containerd", "libpod", "lxc"))


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
