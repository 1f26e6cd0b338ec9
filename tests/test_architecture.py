"""The layout's rules, read from the code's own imports (``ast``, nothing is imported or run).

* The engine never imports the exercises: nothing in ``course/`` imports ``graders``.
* No import circles anywhere in ``course/`` and ``graders/``, counting every import,
  also those inside functions (a lazy import still ties two modules together);
  none between packages either (``course.x.y`` counts as its package ``course.x``).
* Layers one way, from the bottom: process primitives, environment names, errors and
  paths; the sandbox; the launcher; grading; the instructor's verbs; the student's side; the check API; the
  exercises' checks. A layer imports only from its own and those below it.
* The three subsystems and the verbs have rooms of their own, and the CLI's verbs
  point into them.
* One front door: the exercises' checks import from the engine only the check API (``course.checks`` and
  its modules), the errors and the cost model; the launcher, torchrun's included, raises no check failure.
* No module of ``course/`` or ``graders/`` over :data:`MAX_LINES` lines.
* One grader package per exercise notebook, named after it (``graders/ddp_basics/`` for ``ddp_basics.ipynb``),
  plus ``graders.common`` for what several share: a notebook's package imports no other notebook's, and a
  notebook's test cells call only the public names (``EXPORTS``) of its own package.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("course", "graders")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module an imported name lives in (``course.grading.cells.Timeouts`` -> ``course.grading.cells``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str) -> set[str]:
    """Every project module ``name`` imports, at its top level or inside a function."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else _owner(base))
    found.discard(None)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def package_of(name: str) -> str:
    """The package a module belongs to: ``course.grading.cells`` -> ``course.grading``, ``graders.parallelism.checks`` ->
    ``graders``; a top-level module of the engine (``course.errors``) is its own."""
    parts = name.split(".")
    if parts[0] != "course":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 and (ROOT / "course" / parts[1]).is_dir() else name


def package_graph(graph: dict[str, set[str]], package_of=package_of) -> dict[str, set[str]]:
    """``graph`` with every module collapsed into its package (imports inside a package dropped)."""
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        mine = package_of(name)
        packages.setdefault(mine, set()).update(package_of(d) for d in deps)
        packages[mine].discard(mine)
    for deps in list(packages.values()):
        for dep in deps:
            packages.setdefault(dep, set())
    return packages


PACKAGE_GRAPH = package_graph(GRAPH)

#: the engine's layers, bottom first: a package imports only from its own layer and those below
LAYERS = [
    {"course.proc", "course.envnames", "course.errors", "course.paths", "course.costmodel", "course.progress"},
    {"course.sandbox"},
    {"course.launcher"},
    {"course.grading"},
    {"course.instructor"},
    {"course.student"},
    {"course.hub"},
    {"course.checks"},
    {"graders"},
]


def layer_violations(packages: dict[str, set[str]], layers: list[set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every package that imports one of a higher layer, or one in no layer."""
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    return sorted((name, dep) for name, deps in packages.items() if name in level
                  for dep in deps if level.get(dep, len(layers)) > level[name])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_engine_never_imports_the_exercises_checks():
    offenders = {name: sorted(m for m in deps if m.split(".")[0] == "graders")
                 for name, deps in GRAPH.items() if name.split(".")[0] == "course"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    # the rule above must be able to fail
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_packages():
    assert _cycles(PACKAGE_GRAPH) == []


def test_the_package_rule_finds_a_circle_no_module_rule_sees():
    # p.a -> q.b and q.c -> p.d: no circle between files, one between the packages p and q
    modules = {"p.a": {"q.b"}, "p.d": set(), "q.b": set(), "q.c": {"p.d"}, "r": {"p.a"}}
    packages = package_graph(modules, package_of=lambda name: name.split(".")[0])
    assert _cycles(modules) == []
    assert packages == {"p": {"q"}, "q": {"p"}, "r": {"p"}}
    assert _cycles(packages) == [["p", "q"]]


def test_the_package_of_a_module():
    assert package_of("course.grading.cells") == "course.grading"
    assert package_of("course.instructor.autograde.run") == "course.instructor"
    assert package_of("course.sandbox") == "course.sandbox"
    assert package_of("course.errors") == "course.errors"
    assert package_of("course") == "course"
    assert package_of("graders.parallelism.checks") == "graders"


def test_layers_one_way():
    assert layer_violations(PACKAGE_GRAPH, LAYERS) == []


def test_the_layer_rule_can_fail():
    layers = [{"bottom"}, {"low"}, {"high"}]
    assert layer_violations({"bottom": set(), "low": {"bottom"}, "high": {"low", "bottom"}}, layers) == []
    assert layer_violations({"bottom": {"low"}, "low": {"high", "elsewhere"}, "high": set()}, layers) == [
        ("bottom", "low"), ("low", "elsewhere"), ("low", "high")]


@pytest.mark.parametrize("package, never", [
    ("course.sandbox", {"course.launcher", "course.grading", "course.instructor", "course.checks"}),
    ("course.launcher", {"course.grading", "course.instructor", "course.checks"}),
    ("course.grading", {"course.instructor", "course.checks"}),
])
def test_a_lower_package_never_imports_a_higher_one(package, never):
    assert PACKAGE_GRAPH[package] & never == set()


def test_the_bottom_layer_imports_nothing_above_it():
    for name in LAYERS[0]:
        assert PACKAGE_GRAPH[name] <= LAYERS[0], name
    assert PACKAGE_GRAPH["course.errors"] == set()  # the one home for errors, importable from anywhere


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    assert "course.launcher.job" in GRAPH["course"]  # course/__init__ re-exports the launcher
    assert "course.grading.restore" in GRAPH["course.grading.grade"]
    assert "course.grading.execute" in GRAPH["course.grading.pipeline"]
    assert "course.checks" in GRAPH["graders.parallelism.checks"]


@pytest.mark.parametrize("room", [
    "course.launcher.job", "course.launcher.rank",
    "course.grading.pipeline", "course.grading.verifier", "course.grading.restore", "course.grading.scoring",
    "course.launcher.forkserver", "course.launcher.spec", "course.launcher.settings",
    "course.sandbox.box", "course.sandbox.wrapper", "course.sandbox.linux", "course.grading.kernel",
    "course.proc", "course.envnames",
    "course.instructor.autograde.run", "course.instructor.autograde.pool", "course.instructor.autograde.worker",
    "course.checks", "course.checks.torchrun", "course.errors", "graders.ddp_basics.checks", "course.launcher.torchrun",
])
def test_each_subsystem_has_its_room(room):
    assert room in MODULES


def test_every_verb_lives_in_its_own_module():
    from course.cli import COMMANDS

    targets = [target.split(":")[0] for target in COMMANDS.values()]
    assert len(set(targets)) == len(targets)
    for verb, target in COMMANDS.items():
        module, attr = target.split(":")
        assert module in MODULES, verb
        assert callable(getattr(importlib.import_module(module), attr)), verb
    assert COMMANDS["autograde"].startswith("course.instructor.autograde")
    assert COMMANDS["grade"].startswith("course.grading.")


@pytest.mark.parametrize("name", [n for n in MODULES if not n.endswith("__main__")])
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_sandbox_hides_this_checkouts_sources():
    """Paths computed from a module's own location must follow it when it moves (the sandbox's did not once)."""
    from course.paths import CHECKOUT
    from course.sandbox import default_hidden, python_paths

    assert CHECKOUT == ROOT
    assert str(ROOT / "exercises") in default_hidden() and str(ROOT / "tests") in default_hidden()  # tests: whole answers
    assert str(ROOT / ".git") in default_hidden() or not (ROOT / ".git").exists()
    assert str(ROOT) in python_paths()


#: what the exercises' checks may import from the engine: the check API (its package), the errors, the cost model
FRONT_DOOR = ("course.checks", "course.errors", "course.costmodel")
#: a module longer than this is two concerns (or more) in one file
MAX_LINES = 600


def front_door_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{grader module: the engine modules it imports past the front door}, for the modules that do."""
    def inside(dep: str) -> bool:
        return any(dep == door or dep.startswith(door + ".") for door in FRONT_DOOR)

    found = {name: sorted(d for d in deps if d.split(".")[0] == "course" and not inside(d))
             for name, deps in graph.items() if name.split(".")[0] == "graders"}
    return {name: deps for name, deps in found.items() if deps}


def test_graders_import_only_the_check_api_the_errors_and_the_cost_model():
    assert front_door_violations(GRAPH) == {}


def test_the_front_door_rule_can_fail():
    graph = {"graders.a": {"course.checks", "course.checks.torchrun", "course.errors", "graders.b"},
             "graders.b": {"course.launcher.job", "course"}, "course.checks": {"course.launcher.job"}}
    assert front_door_violations(graph) == {"graders.b": ["course", "course.launcher.job"]}


def verdicts_made(name: str) -> set[str]:
    """The check verdicts (``CheckFailed(...)``, ``Mistake(...)``) a module constructs, by name."""
    tree = ast.parse(MODULES[name].read_text())
    return {ast.unparse(node.func).rsplit(".", 1)[-1] for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func).rsplit(".", 1)[-1] in {"CheckFailed", "Mistake"}}


def test_the_launcher_makes_no_verdict():
    """The launcher, torchrun's runner included, runs and reports (it may show a failure: display.py); turning a
    run into a verdict is the check API's (course.checks.torchrun)."""
    judging = {name: sorted(verdicts_made(name)) for name in MODULES if name.startswith("course.launcher")}
    assert {k: v for k, v in judging.items() if v} == {}
    assert verdicts_made("course.checks.torchrun") == {"CheckFailed"}  # the rule sees a verdict where one is made


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (at most {MAX_LINES} lines each): {long}"


# --- one grader package per notebook ---------------------------------------------------------------------

NOTEBOOKS = {path.stem: path for path in ROOT.glob("exercises/*/*.ipynb")}
SHARED = "common"


def notebook_package(name: str) -> str | None:
    """The notebook package a grader module belongs to (``graders.elastic.story`` -> ``elastic``), None for the
    shared one and for modules outside ``graders``."""
    parts = name.split(".")
    return parts[1] if parts[0] == "graders" and len(parts) > 1 and parts[1] != SHARED else None


def crossings(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{grader module: the modules of another notebook's package it imports}; the shared package counts as
    another's for none but may import no notebook's."""
    found = {}
    for name, deps in graph.items():
        if name.split(".")[0] != "graders" or name == "graders":
            continue
        mine = notebook_package(name)
        bad = sorted(d for d in deps if notebook_package(d) not in (None, mine))
        if bad:
            found[name] = bad
    return found


def test_each_exercise_notebook_has_its_grader_package_and_no_other_package_exists():
    packages = {path.parent.name for path in ROOT.glob("graders/*/__init__.py")}
    assert packages - {SHARED} == set(NOTEBOOKS)
    assert not [p.name for p in ROOT.glob("graders/*.py") if p.name != "__init__.py"], "a grader module outside a package"


def test_a_notebooks_checks_import_no_other_notebooks_package():
    assert crossings(GRAPH) == {}


def test_the_crossing_rule_can_fail():
    graph = {"graders.elastic.checks": {"graders.torchrun.probe", "graders.common.torchrun_model", "course.checks"},
             "graders.common.comm_spy": {"graders.ddp_basics.checks"}, "graders.torchrun.checks": {"graders.torchrun.probe"}}
    assert crossings(graph) == {"graders.common.comm_spy": ["graders.ddp_basics.checks"],
                                "graders.elastic.checks": ["graders.torchrun.probe"]}


def _exports(package: str) -> dict[str, str]:
    tree = ast.parse((ROOT / "graders" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and "EXPORTS" in ast.unparse(node).split("=")[0]:
            return ast.literal_eval(node.value)
    return {}


@pytest.mark.parametrize("stem", sorted(NOTEBOOKS))
def test_a_notebook_calls_only_its_own_packages_public_names(stem):
    import nbformat

    exports = _exports(stem)
    for name, module in exports.items():
        defined = ast.parse((ROOT / "graders" / stem / f"{module}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name
                   or isinstance(n, ast.ImportFrom) and name in {a.asname or a.name for a in n.names}
                   for n in defined.body), f"graders.{stem}.{module} has no {name}"
    used = []
    for cell in nbformat.read(str(NOTEBOOKS[stem]), as_version=4).cells:
        if cell.cell_type != "code" or cell.source.startswith("%%"):  # a cell magic: a file's text, not Python
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "graders":
                used.append((node.value.attr, node.attr))
    assert used, f"{stem}.ipynb calls no check"
    wrong = [f"graders.{pkg}.{name}" for pkg, name in used if pkg != stem or name not in exports]
    assert not wrong, f"{stem}.ipynb calls what its package graders.{stem} does not offer: {wrong}"


def test_a_public_name_resolves_to_its_module_object():
    import graders.elastic
    import graders.elastic.checks

    assert graders.elastic.check_elastic_grow is graders.elastic.checks.check_elastic_grow
    with pytest.raises(AttributeError):
        graders.elastic.no_such_check  # noqa: B018
