"""The GPU path's smaller items (issue 39, item 5), checked on a CPU machine: what each demo, spec, image and limit
says or does about GPUs, so that the first GPU run meets what was written here."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_lesson4s_hang_demos_run_on_gloo_whatever_the_machine():
    """monitored_barrier is gloo's only, and nccl's watchdog aborts a timed-out rank instead of raising: every job
    of 'Finding a hang' pins gloo, and the lesson says why."""
    cells = _cells(ROOT / "lessons" / "04-launching-with-torchrun.ipynb")
    start = next(i for i, c in enumerate(cells) if "## 6. Finding a hang" in _source(c))
    end = next(i for i, c in enumerate(cells) if i > start and _source(c).startswith("## Summary"))
    calls = []
    for cell in cells[start:end]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse(_source(cell))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "course.run_ranks":
                calls.append(node)
    assert len(calls) == 5
    for call in calls:
        backend = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg == "backend"}
        assert backend == {"backend": "gloo"}, ast.unparse(call)
    assert "Every job of this section runs on gloo" in _source(cells[start])


def test_the_ex4_specs_say_the_launches_hide_the_gpus_as_the_runner_does():
    runner = (ROOT / "course" / "launcher" / "torchrun" / "runner.py").read_text()
    assert re.search(r'CUDA_VISIBLE_DEVICES="",', runner)  # the runner hides the GPUs from every worker
    for name in ("torchrun.ipynb", "elastic.ipynb"):
        text = " ".join(_source(c) for c in _cells(ROOT / "exercises" / "ex4-torchrun" / name)).replace("\n", " ")
        assert "with the GPUs hidden (`CUDA_VISIBLE_DEVICES` empty)" in text, name
        assert "would pick the same GPU 0" in text, name


@pytest.mark.parametrize("gpus", [3, 4, 8])
def test_with_a_gpu_per_rank_auto_would_pick_nccl_and_the_pinned_demos_keep_gloo(gpus, monkeypatch):
    """Why the pin matters: on 3 or more GPUs the 3-rank demos would run on nccl by 'auto'."""
    import course.launcher.gpus as gpu_module
    from course.launcher import job

    monkeypatch.setattr(gpu_module, "gpu_count", lambda: gpus)
    assert job.resolve_backend("auto", 3) == "nccl"
    assert job.resolve_backend("gloo", 3) == "gloo"


def test_a_torch_installed_without_its_runtime_wheels_is_found():
    """The image installs torch with --no-deps: the CUDA build's nvidia-* wheels must come afterwards, and the build's
    check names any that did not (markers evaluated: extras and other platforms' wheels are not asked for)."""
    from course.launcher.gpus import missing_requirements

    declared = ['nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"', "filelock",
                'optree>=0.13.0; extra == "optree"', 'nvidia-x; platform_system == "Windows"', "sympy>=999"]
    missing = missing_requirements(requires=declared)
    assert missing[0] == declared[0] and missing[1].startswith("sympy>=999 (installed: ") and len(missing) == 2
    assert missing_requirements() == []  # this venv's torch has everything it declares


def test_the_image_build_checks_torchs_requirements_after_the_course_requirements():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    first = dockerfile.index('pip install --no-deps --find-links /tmp/wheels "$@" "torch==${TORCH_VERSION}"')
    requirements = dockerfile.index("pip install -r /tmp/requirements.txt")
    check = dockerfile.index("sys.exit(g.check_install())")
    assert first < requirements < check
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch") for d in deps)  # why torch's own requirements come with the course's


def test_the_sandbox_memory_grows_with_the_gpus_the_notebook_may_use(monkeypatch):
    import course.launcher.gpus as gpus
    from course.grading.kernel import CUDA_RANK_MEMORY, SandboxKernelManager, sandbox_memory
    from course.sandbox import Limits

    assert sandbox_memory(0) == Limits.memory  # sized for gloo ranks: unchanged on a CPU machine
    assert sandbox_memory(4) == Limits.memory + 4 * CUDA_RANK_MEMORY
    monkeypatch.setattr(gpus, "gpu_count", lambda: 2)
    assert SandboxKernelManager().memory_limit == Limits.memory + 2 * CUDA_RANK_MEMORY
    from traitlets.config import Config

    config = Config()
    config.SandboxKernelManager.memory_limit = 5 << 30  # an instructor's setting wins
    assert SandboxKernelManager(config=config).memory_limit == 5 << 30
