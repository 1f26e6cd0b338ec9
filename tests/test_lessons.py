"""Every lesson executes top to bottom, is committed clean, and really runs multi-rank jobs.

Lessons are found by glob, so a new ``lessons/*.ipynb`` is picked up without editing this file.
Execution happens once per session (``executed_lesson`` in conftest.py); the time is printed and
summarised at the end of the run.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import nbformat
import pytest
from lesson_output import stdout_of, world_sizes

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
COMMITTED = LESSONS + sorted((ROOT / "exercises").glob("**/*.ipynb"))
LAUNCHERS = {"run_ranks", "launch"}


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_there_are_lessons():
    assert LESSONS, "no lessons/*.ipynb found"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_lesson_executes_top_to_bottom(path, executed_lesson):
    nb = executed_lesson(path.stem)  # raises CellExecutionError (with the cell) if any cell fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "some code cells did not run"


#: warnings a lesson shows on purpose (it teaches what they mean), by lesson file stem: regexes of the message
TAUGHT_WARNINGS: dict[str, tuple[str, ...]] = {}
_WARNING = re.compile(r"\b(\w*Warning): (.*)")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_lesson_shows_no_warning_it_does_not_teach(path, executed_lesson):
    found = untaught_warnings(executed_lesson(path.stem), TAUGHT_WARNINGS.get(path.stem, ()))
    assert not found, f"{_ids(path)} shows warnings it does not teach:\n" + "\n".join(found)


def untaught_warnings(nb, taught: tuple[str, ...]) -> list[str]:
    """Every warning an executed notebook shows (its ranks' output included) that no ``taught`` regex matches."""
    patterns = [re.compile(p) for p in taught]
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = output.get("text", "") + "".join(str(v) for k, v in output.get("data", {}).items()
                                                    if k == "text/plain")
            for kind, message in _WARNING.findall(text):
                if not any(p.search(message) for p in patterns):
                    found.append(f"cell {index}: {kind}: {message[:200]}")
    return found


def test_the_warning_scan_finds_a_ranks_warning_unless_it_is_taught():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("course.run_ranks(step, 2)")]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=(
        "[rank 0] /x/torch/utils/hooks.py:226: UserWarning: Full backward hook is firing when gradients are computed\n"
        "[rank 0] loss 0.5\n"))]
    assert untaught_warnings(nb, ()) == ["cell 0: UserWarning: Full backward hook is firing when gradients are computed"]
    assert untaught_warnings(nb, (r"^Full backward hook",)) == []


@pytest.mark.parametrize("path", COMMITTED, ids=_ids)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{_ids(path)}: code cells {dirty} carry outputs or execution counts; "
                       "strip them (nbstripout --keep-id) before committing")


def _calls_launcher(source: str) -> bool:
    """Whether the cell itself (not a function it defines) calls course.run_ranks / course.launch."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False

    class Finder(ast.NodeVisitor):
        found = False

        def visit_FunctionDef(self, node):  # a definition runs nothing
            pass

        visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in LAUNCHERS
                    and isinstance(func.value, ast.Name) and func.value.id == "course"):
                self.found = True
            self.generic_visit(node)

    finder = Finder()
    finder.visit(tree)
    return finder.found


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_every_demo_records_a_multi_rank_run(path, executed_lesson):
    nb = executed_lesson(path.stem)
    everything = "".join(stdout_of(c) for c in nb.cells if c.cell_type == "code")
    sizes = world_sizes(everything)
    assert sizes, f"{path.name} printed no 'ran on world_size=N (backend=...)' line: no demo recorded a multi-rank run"
    assert min(sizes) >= 2, f"{path.name} recorded world sizes {sizes}: every demo needs >= 2 ranks"
    demos = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and _calls_launcher(c.source)]
    for i, cell in demos:
        text = stdout_of(cell)
        sizes = world_sizes(text)
        assert sizes, (f"{path.name} cell {i} runs ranks but prints no 'ran on world_size=N (backend=...)' line:\n"
                       f"{cell.source[:300]}")
        assert min(sizes) >= 2, f"{path.name} cell {i} recorded world sizes {sizes}: a demo needs >= 2 ranks"


# --------------------------------------------------------------------------- the rules every lesson's code keeps
# (issue 13): read from the sources, no execution. A rank function joins through the lesson's one setup helper,
# which selects the GPU before init_process_group and binds the group to it; a rank function that joins leaves;
# a script launched with torchrun needs nothing but torch.

JOINERS = {"setup", "init"}  # the lessons' setup helpers (lesson 1 calls its own `init`)
#: rank functions that keep the process group up on purpose, to show what that breaks
KEEPS_THE_GROUP = {"forgets_to_destroy"}


def _code_sources(path: Path) -> list[tuple[str, str]]:
    """(label, python source): each code cell without its magic lines, and each %%writefile script assembled."""
    nb = nbformat.read(path, as_version=4)
    sources, scripts = [], {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        first, _, body = cell.source.partition("\n")
        if first.startswith("%%writefile"):
            name = first.split()[-1].rsplit("/", 1)[-1]
            scripts[name] = (scripts.get(name, "") if " -a " in f" {first} " else "") + body + "\n"
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        sources.append((f"cell {i}", code))
    return sources + [(f"script {name}", text) for name, text in scripts.items()]


def _calls(node: ast.AST) -> list[tuple[str, ast.Call]]:
    """(called name, call) for every call under node, in source order."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            found.append((name, sub))
    return sorted(found, key=lambda item: (item[1].lineno, item[1].col_offset))


def _functions(path: Path):
    for label, source in _code_sources(path):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                yield label, node


@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_the_device_is_selected_before_init_process_group(path):
    seen = 0
    for label, fn in _functions(path):
        calls = _calls(fn)
        inits = [call for name, call in calls if name == "init_process_group"]
        pins = [call for name, call in calls if name == "set_device"]
        if not inits:
            continue
        seen += 1
        if path.name[:2] != "04":  # lessons 1-3 join in one place: their setup helper
            assert fn.name in JOINERS, f"{path.name} {label}: {fn.name}() calls init_process_group itself; use setup()"
        assert pins, f"{path.name} {label}: {fn.name}() joins without ever selecting a GPU for nccl"
        assert max(p.lineno for p in pins) < min(i.lineno for i in inits), (
            f"{path.name} {label}: {fn.name}() calls set_device after init_process_group")
        bound = [i for i in inits if any(k.arg == "device_id" for k in i.keywords)]
        assert bound, f"{path.name} {label}: {fn.name}() never binds the group to its GPU (device_id=)"
    assert seen, f"{path.name}: no function calls init_process_group"


@pytest.mark.parametrize("path", [p for p in LESSONS if p.name[:2] != "04"], ids=_ids)
def test_every_rank_function_that_joins_leaves(path):
    joined = 0
    for label, fn in _functions(path):
        names = {name for name, _ in _calls(fn)}
        if fn.name in JOINERS or not names & (JOINERS | {"init_process_group"}):
            continue
        joined += 1
        if fn.name in KEEPS_THE_GROUP:
            continue
        assert "destroy_process_group" in names, f"{path.name} {label}: {fn.name}() joins the group and never leaves it"
    assert joined, f"{path.name}: no rank function joins a process group"


def test_torchrun_scripts_need_only_torch():
    scripts = [(path, label, source) for path in LESSONS for label, source in _code_sources(path)
               if label.startswith("script ")]
    assert scripts, "no %%writefile script in the lessons"
    for path, label, source in scripts:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for module in modules:
                    top = module.split(".")[0]
                    assert top == "torch" or top in sys.stdlib_module_names, (
                        f"{path.name} {label} imports {module}: a script copied to a cluster has only torch")
