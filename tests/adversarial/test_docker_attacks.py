"""The Docker grading path attacked (issue 38): attack submissions graded in the grader image, run with the flags
docker/README.md documents (``tests/test_docker.py``'s ``GRADER_RUN_FLAGS``), as an instructor grades there.

There the sandbox cannot isolate (Docker's default seccomp profile refuses the user namespaces it needs): the
submission runs as the container's user, who owns the mounted folders. Before Landlock confined it
(:mod:`course.sandbox.landlock`), the write attack below wrote into another student's submission beside it
(measured 2026-12-06); now the kernel refuses it every write outside its own folder and every read of the
sources, the course folder, the homes and /tmp.

The attacks played are those whose outcome can differ inside the container (the table above
``attacks.ATTACKS`` says why for each path): the image holds the course's source notebooks and its own
gradebook-free course folder, the mounted folder holds other students' work, and the container's user has a
home of its own where planted modules would wait for the verifier. Each submission must earn exactly its honest
points; none may read a solution or hidden test, write outside its sandbox, or get a module of its own imported
by the trusted verifier.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attacks
import nbformat
import pytest
from test_docker import GRADER_RUN_FLAGS, docker, engine, grader_image, unavailable  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "exercises" / "ex1-parallelism" / "parallelism.ipynb"
PLAYED = ("read_sources", "write_gradebook", "plant_modules")

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(900)
def test_attacks_graded_in_the_grader_image_earn_their_honest_points_and_reach_nothing(
        grader_image, tmp_path):  # noqa: F811 - test_docker's fixture
    if docker("run", "--rm", "--network", "none", grader_image, "grade", "--help", check=False).returncode != 0:
        unavailable(f"`ddp-course grade` does not run in {grader_image}: rebuild it (docker/ci/build.sh)")
    source = nbformat.read(str(SOURCE), as_version=4)
    work, folder = tmp_path / "work", SOURCE.parent.name
    honest = work / "honest" / folder / SOURCE.name  # another student's submission in the mounted folder
    honest.parent.mkdir(parents=True)
    honest.write_bytes(nbformat.writes(attacks.build(attacks.ATTACKS[0], source, {})[1]).encode())
    ctx = {"listeners": [], "secret_paths": [], "victim_paths": [f"/work/honest/{folder}/{SOURCE.name}"],
           "victim_dirs": [f"/work/honest/{folder}"]}
    by_name = {a.name: a for a in attacks.ATTACKS}
    before = _digest(honest)
    for name in PLAYED:
        attack = attacks.for_path(by_name[name], "grade")
        raw, nb = attacks.build(attack, source, ctx)
        (work / name / folder).mkdir(parents=True)
        (work / name / folder / SOURCE.name).write_bytes(raw)
    for path in [work, *work.rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)  # the container's uid 1000 works here

    for name in PLAYED:
        attack = attacks.for_path(by_name[name], "grade")
        _, nb = attacks.build(attack, source, ctx)
        proc = docker("run", "--rm", *GRADER_RUN_FLAGS, "-v", f"{work}:/work", grader_image, "grade",
                      f"/work/{name}/{folder}/{SOURCE.name}", "--json", "-o", f"/work/{name}/graded.ipynb",
                      timeout=840, check=False)
        assert proc.returncode == 0 and proc.stdout.strip(), f"{name}: grade exited {proc.returncode}:\n" \
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        report = json.loads(proc.stdout)
        scores = {t["id"]: t["score"] for t in report["tests"]}
        assert scores == attacks.expected_scores(attack, source, nb), f"{name}: {report}"
        graded = nbformat.read(str(work / name / "graded.ipynb"), as_version=4)
        text = "".join(o.get("text", "") for c in graded.cells if c.cell_type == "code" for o in c.get("outputs", []))
        if name == "read_sources":
            assert f"{attacks.READ_MARK} secrets read: 0" in text, text[-3000:]
            for line in attacks.hidden_lines(source):
                assert line not in text, f"a hidden test reached the submission in the container: {line}"
        elif name == "write_gradebook":
            assert f"{attacks.WRITE_MARK} wrote" not in text and f"{attacks.WRITE_MARK} planted" not in text, \
                text[-3000:]
        else:
            assert "PWNED" not in text and "passed check" not in text.replace("passed check_", ""), text[-3000:]
    assert _digest(honest) == before and not (honest.parent / "planted.txt").exists()
