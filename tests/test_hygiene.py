"""Repository hygiene: lint clean, and the notebook stripper keeps nbgrader's metadata."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    proc = subprocess.run([ruff, "check", "course", "graders", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nbstripout_keeps_nbgrader_metadata(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("graders.parallelism.check_shards(shard)")
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": "shards", "locked": True, "points": 2,
                                 "schema_version": 3, "solution": False}
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="passed\n")]
    cell.execution_count = 3
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "nbstripout", "--keep-id", str(path)], check=True)
    stripped = nbformat.read(path, as_version=4).cells[0]
    assert stripped.outputs == [] and stripped.execution_count is None
    assert stripped.metadata["nbgrader"]["grade_id"] == "shards"
    assert stripped.metadata["nbgrader"]["points"] == 2


def test_cli_help_and_version():
    out = subprocess.run(["ddp-course", "--help"], capture_output=True, text=True, check=True).stdout
    assert "lab" in out
    version = subprocess.run(["ddp-course", "--version"], capture_output=True, text=True, check=True).stdout
    assert "ddp-course, version" in version
    dry = subprocess.run(["ddp-course", "lab", "--dry-run", "--no-browser", "--port", "8899"],
                         capture_output=True, text=True, check=True).stdout
    assert "jupyterlab" in dry and "--ServerApp.port=8899" in dry and "--no-browser" in dry
