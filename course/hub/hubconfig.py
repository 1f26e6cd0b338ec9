"""The hub's own configuration file (``<class>/hub/jupyterhub_config.py``), written at each start.

JupyterHub behind its configurable-http-proxy, on the addresses given; PAM logins for the roster's accounts
only (instructors are the hub's admins); each server started as its person's Linux user by JupyterHub's local
spawner, running :mod:`course.hub.singleuser` with their role; the progress page as a hub-managed service
(:mod:`course.hub.service`) that every user may open; optionally jupyterhub-idle-culler stopping idle servers,
and HTTPS with the hub's own certificate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from course.hub.layout import ClassDir
from course.hub.roster import Member

TEMPLATE = '''\
# JupyterHub settings of a ddp-course class server, written by `ddp-course hub start` at each start (edits are lost:
# change the roster or the command's options instead).
c = get_config()  # noqa: F821

ROLES = {roles}

c.JupyterHub.bind_url = {bind_url!r}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = {proxy_api!r}
c.ConfigurableHTTPProxy.pid_file = {proxy_pid!r}
c.JupyterHub.db_url = {db_url!r}
c.JupyterHub.cookie_secret_file = {cookie_secret!r}
c.JupyterHub.pid_file = {hub_pid!r}

# who may log in: the roster's accounts, with the passwords of this machine (PAM); instructors administer the hub
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.open_sessions = False
c.Authenticator.allowed_users = set(ROLES)
c.Authenticator.admin_users = {{name for name, role in ROLES.items() if role == "instructor"}}

# each server runs as its person's own Linux user, first making their workspace (course/hub/singleuser.py)
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{python!r}, "-m", "course.hub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.Spawner.environment = {{"DDP_COURSE_HUB_DIR": {class_dir!r}}}


def set_role(spawner):
    spawner.environment["DDP_COURSE_HUB_ROLE"] = ROLES.get(spawner.user.name, "student")


c.Spawner.pre_spawn_hook = set_role

# the progress page: each student sees their own, instructors the class (course/hub/service.py)
c.JupyterHub.services = [{{
    "name": "progress",
    "url": {service_url!r},
    "command": [{python!r}, "-m", "course.hub.service", "--roster", {roles_file!r}, "--edition", {edition!r}],
    "oauth_no_confirm": True,
    "display": True,
}}]
c.JupyterHub.load_roles = [
    {{"name": "user", "scopes": ["self", "access:services!service=progress"]}},
]
'''

IDLE_CULLER = '''
# servers idle for {minutes} minutes are stopped (jupyterhub-idle-culler; a student's work stays in their home)
c.JupyterHub.services.append({{
    "name": "idle-culler",
    "command": [{python!r}, "-m", "jupyterhub_idle_culler", "--timeout={seconds}"],
}})
c.JupyterHub.load_roles.append({{
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
}})
'''

SSL = '''
# HTTPS: the hub's own certificate
c.JupyterHub.ssl_cert = {cert!r}
c.JupyterHub.ssl_key = {key!r}
'''


@dataclass(frozen=True)
class Ports:
    public: int
    hub: int
    proxy_api: int
    service: int


def render(classdir: ClassDir, members: list[Member], ip: str, ports: Ports, idle_minutes: int = 0,
           ssl: tuple[str, str] | None = None) -> str:
    """The hub's config; ``idle_minutes`` > 0 stops servers idle that long, ``ssl`` = (cert, key) serves HTTPS."""
    hub = classdir.hub
    roles = {m.username: m.role for m in members}
    text = TEMPLATE.format(
        roles=json.dumps(roles, indent=1, sort_keys=True),
        bind_url=f"{'https' if ssl else 'http'}://{ip}:{ports.public}",
        hub_port=ports.hub,
        proxy_api=f"http://127.0.0.1:{ports.proxy_api}",
        proxy_pid=str(hub / "proxy.pid"),
        hub_pid=str(hub / "jupyterhub.pid"),
        db_url=f"sqlite:///{hub / 'jupyterhub.sqlite'}",
        cookie_secret=str(classdir.cookie_secret),
        python=sys.executable,
        class_dir=str(classdir.root),
        service_url=f"http://127.0.0.1:{ports.service}",
        roles_file=str(classdir.roles),
        edition=str(classdir.edition),
    )
    if idle_minutes > 0:
        text += IDLE_CULLER.format(minutes=idle_minutes, seconds=idle_minutes * 60, python=sys.executable)
    if ssl is not None:
        text += SSL.format(cert=str(ssl[0]), key=str(ssl[1]))
    return text
