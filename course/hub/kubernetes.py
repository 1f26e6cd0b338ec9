"""A class that outgrows one machine: Helm values for Zero to JupyterHub (the ``jupyterhub`` chart).

``ddp-course hub helm-values --roster roster.csv --image REGISTRY/ddp-course:hub`` writes them. What differs
from the one-machine server (:mod:`course.hub.command`), and why:

- **People are not Linux accounts.** Every single-user pod runs as one uid (:data:`UID`); students are kept
  apart by what each pod *mounts*: a student's pod mounts the exchange's released assignments and feedback
  read-only and, read-write, only its own inbound folder (a ``subPath`` of ``{username}``, made by an init
  container that runs as root, mode 0700); an instructor's pod mounts the whole exchange and the course.
  So collect files by inbound folder (``ExchangeCollect.owner_is_student = False``, written into the
  image's instructor config by ``ddp-course hub image-setup --kubernetes``).
- **Logins** go through the chart's NativeAuthenticator (each roster name signs up once with a password of its
  own; names off the roster cannot), roles come from the roster as on one machine (instructors are admins).
- **The image** is docker/Dockerfile's ``hub`` target, whose class folder :data:`CLASS_DIR` holds the lessons'
  edition and each role's settings (built in, readable by all) and whose exercise sources only root reads. Its
  uid 1000 is named ``jovyan``, the name on which nbgrader takes the student's name from the hub
  (``JUPYTERHUB_USER``) rather than from the uid.
- **Grading** runs outside the hub, through the course's Kubernetes Indexed Job (``ddp-course k8s-job`` with the
  course volume, ``--pvc``), on the same ReadWriteMany volume the instructors' pods mount at the same path.

Volumes: two PersistentVolumeClaims, made by the instructor (ReadWriteMany): the exchange
(:data:`EXCHANGE_CLAIM`) and the course (:data:`COURSE_CLAIM`).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import PurePosixPath

from course.hub.roster import Member

#: the class folder inside the hub image (edition and settings built in; exchange and course mounted)
CLASS_DIR = PurePosixPath("/opt/ddp-course-class")
UID = 1000
GID = 100
EXCHANGE_CLAIM = "ddp-course-exchange"
COURSE_CLAIM = "ddp-course-course"

HOOK = '''\
# ddp-course: each person's role from the roster, and what their pod mounts (course/hub/kubernetes.py)
import json

ROLES = json.loads({roles!r})
INSTRUCTOR_MOUNTS = json.loads({instructor_mounts!r})


def ddp_course_role(spawner):
    role = ROLES.get(spawner.user.name, "student")
    spawner.environment["DDP_COURSE_HUB_ROLE"] = role
    if role == "instructor":  # the whole exchange and the course, instead of a student's three mounts
        spawner.volume_mounts = [m for m in spawner.volume_mounts if m["name"] != "exchange"] + INSTRUCTOR_MOUNTS
        spawner.init_containers = []


c.KubeSpawner.pre_spawn_hook = ddp_course_role  # noqa: F821 - the chart's hub config provides c
'''


def exchange_path(course_id: str) -> PurePosixPath:
    return CLASS_DIR / "exchange" / course_id


def student_mounts(course_id: str) -> list[dict]:
    here = exchange_path(course_id)
    return [
        {"name": "exchange", "mountPath": str(here / "outbound"), "subPath": f"{course_id}/outbound",
         "readOnly": True},
        {"name": "exchange", "mountPath": str(here / "feedback"), "subPath": f"{course_id}/feedback",
         "readOnly": True},
        {"name": "exchange", "mountPath": str(here / "inbound" / "{username}"),
         "subPath": f"{course_id}/inbound/{{username}}"},
    ]


def instructor_mounts(course_id: str) -> list[dict]:
    return [
        {"name": "exchange", "mountPath": str(CLASS_DIR / "exchange"), "readOnly": False},
        {"name": "course", "mountPath": str(CLASS_DIR / "course")},
    ]


def inbound_init_container(image: str, course_id: str) -> dict:
    """Makes the student's own inbound folder (and the exchange's shared ones) before their pod starts."""
    root = f"/exchange/{course_id}"
    script = (f"mkdir -p {root}/outbound {root}/feedback {root}/inbound/{{username}} && "
              f"chown {UID}:{GID} {root}/inbound/{{username}} && chmod 0700 {root}/inbound/{{username}}")
    return {"name": "ddp-course-inbound", "image": image, "command": ["sh", "-c", script],
            "securityContext": {"runAsUser": 0},
            "volumeMounts": [{"name": "exchange", "mountPath": "/exchange"}]}


def values(members: list[Member], image: str, course_id: str = "ddp-course", home_size: str = "2Gi") -> dict:
    """The chart's values for this class."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    roles = {m.username: m.role for m in members}
    hook = HOOK.format(roles=json.dumps(roles, sort_keys=True),
                       instructor_mounts=json.dumps(instructor_mounts(course_id)))
    return {
        "hub": {
            "config": {
                "JupyterHub": {"authenticator_class": "nativeauthenticator.NativeAuthenticator"},
                "Authenticator": {"allowed_users": sorted(roles),
                                  "admin_users": sorted(n for n, r in roles.items() if r == "instructor")},
                "NativeAuthenticator": {"open_signup": False, "enable_signup": True,
                                        "check_common_password": True, "minimum_password_length": 10},
            },
            "extraConfig": {"ddp-course": hook},
        },
        "singleuser": {
            "image": {"name": name, "tag": tag or "latest"},
            "cmd": ["python3", "-m", "course.hub.singleuser"],
            "defaultUrl": "/lab",
            "uid": UID,
            "fsGid": GID,
            "extraEnv": {"DDP_COURSE_HUB_DIR": str(CLASS_DIR)},
            # ranks exchange tensors through /dev/shm: a kernel's multi-rank jobs need more than 64 MiB
            "storage": {
                "type": "dynamic", "capacity": home_size, "homeMountPath": "/home/jovyan",
                "extraVolumes": [
                    {"name": "exchange", "persistentVolumeClaim": {"claimName": EXCHANGE_CLAIM}},
                    {"name": "course", "persistentVolumeClaim": {"claimName": COURSE_CLAIM}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                ],
                "extraVolumeMounts": [*student_mounts(course_id), {"name": "shm", "mountPath": "/dev/shm"}],
            },
            "initContainers": [inbound_init_container(f"{name}:{tag or 'latest'}", course_id)],
            "cpu": {"limit": 2, "guarantee": 1},
            "memory": {"limit": "4G", "guarantee": "2G"},
        },
    }


def render(members: list[Member], image: str, course_id: str = "ddp-course") -> str:
    import yaml

    head = textwrap.dedent(f"""\
        # Zero to JupyterHub values for a ddp-course class (written by `ddp-course hub helm-values`).
        # helm upgrade --install class jupyterhub/jupyterhub -f THIS_FILE
        # First make two ReadWriteMany PersistentVolumeClaims: {EXCHANGE_CLAIM} and {COURSE_CLAIM}.
        # Instructors then run `ddp-course init {CLASS_DIR}/course` once in their lab; grading: `ddp-course
        # k8s-job --pvc {COURSE_CLAIM} --course-mount {CLASS_DIR}/course` (docs/class-server.md).
        """)
    class Dumper(yaml.SafeDumper):
        pass

    def text_block(dumper, value):  # the hook's Python as a block, readable in the file
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text_block)
    return head + yaml.dump(values(members, image, course_id), Dumper=Dumper, sort_keys=False, width=120)
