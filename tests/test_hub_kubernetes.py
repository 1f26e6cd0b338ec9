"""The class on Kubernetes, checked offline: the Zero to JupyterHub values `ddp-course hub helm-values` writes, the
pods KubeSpawner would make from them (validated against the Kubernetes API's schemas), and what each role's pod
mounts: a student's pod reaches only its own inbound folder, read-write."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from course.hub import kubernetes
from course.hub.roster import Member

VERSIONS = ("1.33", kubernetes_validate.utils.latest_version())
MEMBERS = [Member("ada", "student"), Member("bob", "student"), Member("grace", "instructor")]


def expand(value, username: str):
    """KubeSpawner's expansion of {username} in mounts, volumes and init containers."""
    if isinstance(value, str):
        return value.replace("{username}", username)
    if isinstance(value, list):
        return [expand(v, username) for v in value]
    if isinstance(value, dict):
        return {k: expand(v, username) for k, v in value.items()}
    return value


def spawn(values: dict, username: str) -> dict:
    """The pod KubeSpawner makes for ``username`` from the chart's values, after the values' pre-spawn hook."""
    single = values["singleuser"]
    config = SimpleNamespace(KubeSpawner=SimpleNamespace())
    exec(compile(values["hub"]["extraConfig"]["ddp-course"], "ddp-course", "exec"), {"c": config})  # noqa: S102
    spawner = SimpleNamespace(user=SimpleNamespace(name=username), environment={},
                              volume_mounts=copy.deepcopy(single["storage"]["extraVolumeMounts"]),
                              init_containers=copy.deepcopy(single["initContainers"]))
    config.KubeSpawner.pre_spawn_hook(spawner)
    image = f"{single['image']['name']}:{single['image']['tag']}"
    home = {"name": "home", "mountPath": single["storage"]["homeMountPath"]}
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"jupyter-{username}"},
        "spec": {
            "securityContext": {"fsGroup": single["fsGid"]},
            "initContainers": expand(spawner.init_containers, username),
            "containers": [{"name": "notebook", "image": image, "args": single["cmd"],
                            "securityContext": {"runAsUser": single["uid"]},
                            "env": [{"name": k, "value": v} for k, v in {**single["extraEnv"],
                                                                           **spawner.environment}.items()],
                            "volumeMounts": [home, *expand(spawner.volume_mounts, username)]}],
            "volumes": [{"name": "home", "persistentVolumeClaim": {"claimName": f"claim-{username}"}},
                        *expand(single["storage"]["extraVolumes"], username)],
        },
    }
    return pod


@pytest.fixture(scope="module")
def values(tmp_path_factory) -> dict:
    roster = tmp_path_factory.mktemp("roster") / "roster.csv"
    roster.write_text("username,role\n" + "".join(f"{m.username},{m.role}\n" for m in MEMBERS))
    out = roster.parent / "values.yaml"
    subprocess.run(["ddp-course", "hub", "helm-values", "--roster", str(roster), "--image",
                    "registry.internal:5000/ddp-course:hub", "-o", str(out)], check=True, capture_output=True)
    return yaml.safe_load(out.read_text())


def test_the_roster_decides_who_logs_in_and_who_administers(values):
    config = values["hub"]["config"]
    assert config["Authenticator"]["allowed_users"] == ["ada", "bob", "grace"]
    assert config["Authenticator"]["admin_users"] == ["grace"]
    assert config["NativeAuthenticator"]["open_signup"] is False
    assert values["singleuser"]["image"] == {"name": "registry.internal:5000/ddp-course", "tag": "hub"}
    assert values["singleuser"]["cmd"][1:] == ["-m", "course.hub.singleuser"]


@pytest.mark.parametrize("username", ["ada", "grace"])
def test_each_pod_is_a_valid_kubernetes_pod(values, username):
    pod = spawn(values, username)
    for version in VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    names = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
            for m in c["volumeMounts"]} <= names


def test_a_students_pod_writes_only_to_its_own_inbound_folder(values):
    pod = spawn(values, "ada")
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DDP_COURSE_HUB_ROLE"] == "student"
    exchange = [m for m in container["volumeMounts"] if m["name"] == "exchange"]
    writable = [m["subPath"] for m in exchange if not m.get("readOnly")]
    assert writable == ["ddp-course/inbound/ada"], exchange
    assert sorted(m["subPath"] for m in exchange if m.get("readOnly")) == ["ddp-course/feedback",
                                                                            "ddp-course/outbound"]
    assert all(m["name"] != "course" for m in container["volumeMounts"]), "a student never mounts the course"
    assert all("subPath" in m for m in exchange), "a student never mounts the whole exchange"
    init = pod["spec"]["initContainers"][0]
    script = init["command"][-1]
    assert "inbound/ada " in script + " " and "chmod 0700" in script and "{username}" not in script


def test_an_instructors_pod_mounts_the_whole_exchange_and_the_course(values):
    pod = spawn(values, "grace")
    container = pod["spec"]["containers"][0]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["exchange"]["mountPath"] == str(kubernetes.CLASS_DIR / "exchange") and "subPath" not in mounts["exchange"]
    assert mounts["course"]["mountPath"] == str(kubernetes.CLASS_DIR / "course")
    assert pod["spec"]["initContainers"] == []
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DDP_COURSE_HUB_ROLE"] == "instructor"


def test_the_images_class_folder_collects_by_inbound_folder(tmp_path):
    from course.hub.layout import ClassDir

    folder = ClassDir(Path(tmp_path), accounts=False)
    assert "c.ExchangeCollect.owner_is_student = False" in folder.nbgrader_config("instructor")
    assert "owner_is_student" not in ClassDir(Path(tmp_path)).nbgrader_config("instructor")
    assert str(kubernetes.CLASS_DIR) in json.dumps(kubernetes.values(MEMBERS, "i:t")["singleuser"]["extraEnv"])
