"""The verifier's pieces: parsing check calls, proxies that never run student code in-process,
verdicts written back into the notebook, and the audit of the graders (every check is re-runnable)."""

from __future__ import annotations

import importlib
import inspect
import os
import pickle

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from course.grading import checkcalls
from course.grading.student import StudentObject, StudentObjectUsed
from course.grading.verifier import Verdict, apply_verdicts

pytestmark = pytest.mark.timeout(120)


def test_parse_check_calls():
    calls = checkcalls.parse("graders.parallelism.check_shards(shard_batch)\n### BEGIN HIDDEN TESTS\n"
                             "graders.parallelism.check_shards(shard_batch, world_sizes=(4,), batch_sizes=(16, 10))\n"
                             "### END HIDDEN TESTS")
    assert [str(c) for c in calls] == ["graders.parallelism.check_shards(shard_batch)",
                                       "graders.parallelism.check_shards(shard_batch, world_sizes=(4,), batch_sizes=(16, 10))"]
    assert calls[1].names == ["shard_batch"]
    assert checkcalls.parse("graders.torchrun.check_ddp_training('train.py')")[0].strings == ["train.py"]
    for not_a_check in ("assert double(2) == 4", "graders.parallelism.check_shards(f(x))", "x = graders.parallelism.check_a(f)",
                        "graders.parallelism._private(f)", "import os\ngraders.parallelism.check_a(f)", "graders.parallelism.check_a(*fs)",
                        "check_a(f)", "", "syntax error("):
        assert checkcalls.parse(not_a_check) is None, not_a_check


def test_a_call_resolves_only_to_a_check_defined_in_the_package_it_names(tmp_path, monkeypatch):
    """``graders.<notebook>.check_x`` runs a check defined in one of that package's modules; a name the package (or
    a module) merely imports from elsewhere is refused, as is a name it does not have."""
    from course.grading.verifier import _resolve

    pkg = tmp_path / "mychecks"
    (pkg / "part").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from mychecks.part.checks import check_mine\nfrom os.path import join as check_foreign\n")
    (pkg / "part" / "__init__.py").write_text("")
    (pkg / "part" / "checks.py").write_text("from os.path import exists as check_borrowed\n\ndef check_mine(f):\n    return 1\n")
    (tmp_path / "flat.py").write_text("from mychecks.part.checks import check_mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    call = lambda module, name: checkcalls.CheckCall(module, name, (), ())  # noqa: E731
    assert _resolve(call("mychecks", "check_mine"))(None) == 1
    assert _resolve(call("mychecks.part.checks", "check_mine"))(None) == 1
    for module, name in [("mychecks", "check_foreign"), ("mychecks.part.checks", "check_borrowed"),
                         ("mychecks", "check_none"), ("flat", "check_mine")]:
        with pytest.raises(LookupError):
            _resolve(call(module, name))


class _Bomb:
    """Unpickling this would create a file: proof of where student bytes are unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_student_object_never_unpickles_here(tmp_path):
    marker = tmp_path / "unpickled"
    obj = StudentObject("make_loader", pickle.dumps(_Bomb(str(marker))))
    data = pickle.dumps(obj)  # as the launcher ships it to the ranks
    assert not marker.exists()
    with pytest.raises(StudentObjectUsed, match="make_loader.sampler"):
        _ = obj.sampler
    assert obj.misuse == ["sampler"]
    assert callable(obj) and obj.__name__ == "make_loader"
    with pytest.raises(TypeError):  # what graders.harness's stub detection runs: no source, no code
        inspect.getsource(obj)
    assert not marker.exists()
    pickle.loads(data)  # what a rank does: only there does the student's payload run
    assert marker.exists()


def test_apply_verdicts_rewrites_test_outputs():
    meta = {"nbgrader": {"grade": True, "grade_id": "t", "points": 2, "solution": False, "locked": True}}
    nb = new_notebook(cells=[new_code_cell("graders.parallelism.check_shards(shard_batch)", metadata=meta,
                                           outputs=[new_output("stream", name="stdout", text="passed check_shards\n")]),
                             new_code_cell("graders.parallelism.check_x(f)", metadata={**meta, "nbgrader": {**meta["nbgrader"], "grade_id": "u"}},
                                           outputs=[new_output("error", ename="CheckFailed", evalue="no", traceback=[])])])
    apply_verdicts(nb, [Verdict(0, "t", "failed", "FAILED check_shards: overlap"),
                        Verdict(1, "u", "passed", stdout="passed check_x\n")])
    first, second = nb.cells[0].outputs, nb.cells[1].outputs
    assert len(first) == 1 and first[0].output_type == "error" and first[0].evalue == "FAILED check_shards: overlap"
    assert second == [new_output("stream", name="stdout", text="passed check_x\n")]
    from nbgrader.utils import determine_grade

    assert [determine_grade(c)[0] for c in nb.cells] == [0, 2]


def test_the_kernel_runs_no_check_only_a_note_of_what_the_checks_use():
    """Each check runs once, in the verifier: the kernel gets a comment naming the objects and files to
    record; a hidden call reveals only names and plain file names, never its other literals."""
    source = ("graders.torchrun.check_ddp_training('train.py', steps=3)\n### BEGIN HIDDEN TESTS\n"
              "graders.torchrun.check_restart(make_model, 'ckpt.pt', 'the hidden answer is 42')\n### END HIDDEN TESTS")
    ran = checkcalls.kernel_source(source)
    assert ran.startswith(checkcalls.USES_PREFIX) and "\n" not in ran
    assert "graders" not in ran and "check_" not in ran and "hidden answer" not in ran and "steps" not in ran
    assert checkcalls.parse(ran) is None
    assert checkcalls.uses(ran) == (["make_model"], ["train.py", "ckpt.pt"])
    compile(ran, "cell", "exec")  # the kernel can run it
    for not_a_check in ("assert double(2) == 4", "print(graders.parallelism.check_a(f))"):
        assert checkcalls.kernel_source(not_a_check) == not_a_check  # runs in the kernel as written


def _modules():
    """Every module of the graders' notebook packages and of their shared one (``ddp_basics.sampler``, ...)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "graders")
    found = sorted(f"{package}.{name[:-3]}" for package in os.listdir(root) if os.path.isdir(os.path.join(root, package))
                   for name in os.listdir(os.path.join(root, package))
                   if name.endswith(".py") and name != "__init__.py")
    assert len(found) > 30, found  # every grader module: none may go unaudited by a layout the walk misses
    return found


def _unsafe_loads(tree) -> list[str]:
    """Calls that decode data in a way that can run code: pickle/cloudpickle loads, torch.load without weights_only."""
    import ast

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "dill.loads"):
            found.append(f"line {node.lineno}: {name}")
        if name in ("torch.load", "torch.serialization.load"):
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            if not weights_only or not (isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value):
                found.append(f"line {node.lineno}: {name} without weights_only=True")
    return found


@pytest.mark.parametrize("module", _modules())
def test_graders_audit(module):
    """The checks run in the trusted verifier: none may decode student data unsafely."""
    import ast

    mod = importlib.import_module(f"graders.{module}")
    assert _unsafe_loads(ast.parse(inspect.getsource(mod))) == []


def test_every_exercise_test_cell_can_be_reverified():
    """Every test cell of every exercise is a check call the verifier can re-run (none graded by the kernel alone)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "exercises")
    found = 0
    for folder in sorted(os.listdir(root)):
        for name in os.listdir(os.path.join(root, folder)):
            if not name.endswith(".ipynb"):
                continue
            nb = nbformat.read(os.path.join(root, folder, name), as_version=4)
            for cell in nb.cells:
                if cell.get("metadata", {}).get("nbgrader", {}).get("grade") and cell.cell_type == "code":
                    found += 1
                    calls = checkcalls.parse(cell.source)
                    assert calls, f"{folder}/{name}: {cell.metadata.nbgrader.grade_id} is not a check call"
                    for call in calls:
                        module = importlib.import_module(call.module)
                        assert callable(getattr(module, call.function, None)), str(call)
    if not found:
        pytest.skip("no exercise notebooks yet")


def test_calling_a_student_function_runs_it_as_a_one_rank_job():
    """A check that calls a student function directly gets its (weights-only decoded) result from a rank."""
    from course.errors import LaunchError
    from course.launcher.job import dumps

    def double(x):
        import os

        return {"value": 2 * x, "pid": os.getpid()}

    result = StudentObject("double", dumps(double))(21)
    assert result["value"] == 42 and result["pid"] != os.getpid()

    def sneaky():
        return _Bomb("/nonexistent/never-created")  # not plain data: the rank's result is refused

    with pytest.raises(LaunchError, match="cannot"):
        StudentObject("sneaky", dumps(sneaky))()
