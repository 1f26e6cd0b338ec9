"""Hostile and broken submissions, each built from a solution notebook plus one attack.

An :class:`Attack` turns the base (a source notebook with its solutions) into
a submission, and says what grading must give it: the points its honest part
earns and no more, a message that names what happened, within a time bound.
Attacks are written against the structure of the base (its answer cells, its
first test cell), so they work on exercise 1 and on the small test exercise.
"""

from __future__ import annotations

import ast
import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import nbformat
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell

from course.grading import checkcalls

#: every limit the suite runs under (seconds); the bounds below are made of them
CHECK_TIMEOUT = 20  # one job of a check (DDP_COURSE_CHECK_TIMEOUT)
TEST_TIMEOUT = 120  # a test cell
CELL_TIMEOUT = 15  # any other cell
GRACE = 10  # a timed-out cell's kernel is stopped this long after the interrupt
ROOT = os.geteuid() == 0  # the full sandbox (a uid and cgroup per submission); else the rootless one
STARTUP = 150  # kernel and verifier start, imports, cold forkservers, on a busy 2-core machine


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def test_cells(nb) -> list[NotebookNode]:
    return [c for c in nb.cells if nbgrader_meta(c).get("grade") and c.cell_type == "code"]


def answer_cells(nb) -> list[NotebookNode]:
    return [c for c in nb.cells if nbgrader_meta(c).get("solution")]


def defined_names(cell) -> set[str]:
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return set()
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def uses(test, names: set[str]) -> bool:
    """Whether a test cell's check calls pass any of ``names``."""
    calls = checkcalls.parse(test.source) or []
    return any(set(c.names) & names for c in calls)


def strip_hidden_tests(nb) -> NotebookNode:
    """The student's view of the test cells: hidden tests removed (they only exist in the sources)."""
    nb = copy.deepcopy(nb)
    for cell in test_cells(nb):
        cell.source = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", "", cell.source, flags=re.S)
    return nb


def hidden_lines(source_nb) -> list[str]:
    """Lines of the hidden tests (what a submission must never get to see)."""
    found = []
    for cell in test_cells(source_nb):
        for block in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", cell.source, flags=re.S):
            found += [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
    return found


def break_answer(cell) -> None:
    """Replace the solution region of an answer cell by a wrong (but written) body."""
    cell.source = re.sub(r"(\n[ \t]*)### BEGIN SOLUTION.*?### END SOLUTION", r"\1return None", cell.source, flags=re.S)


def insert_after_first_test(nb, source: str) -> int:
    """Insert a code cell after the first test cell; its index."""
    first = test_cells(nb)[0]
    index = nb.cells.index(first) + 1
    nb.cells.insert(index, new_code_cell(source))
    return index


@dataclass
class Attack:
    name: str
    #: what the attack does to the submission (in place); may return bytes to write instead of a notebook
    build: Callable[[NotebookNode, dict], bytes | None]
    #: what stops it (for the report)
    stopped_by: str
    #: answer cells (by position) the attack makes wrong: their tests earn nothing
    broken_answers: tuple[int, ...] = ()
    #: the attack cell kills or hangs the kernel: tests after it earn nothing
    fatal: bool = False
    #: a fatal attack the kernel may also survive (the interrupt at the cell's time limit stopped it): then
    #: the tests after it run and earn their honest points, as after any interrupted endless loop
    survivable: bool = False
    #: the submission cannot be graded at all (everything 0, with an error)
    ungradable: bool = False
    #: graded, but every test earns 0 (e.g. nbgrader does not put deleted test cells back)
    zero: bool = False
    #: regex one of the report's messages (or notes) must match
    message: str = ""
    #: extra time the attack may cost beyond a normal grading (seconds)
    extra: float = 0.0
    #: the file name to submit under (None: the source's)
    file_name: str | None = None
    #: "grade" or "autograde" when the expected outcome differs by path
    per_path: dict = field(default_factory=dict)
    #: the grading paths it is played on: those where its outcome can differ (see the table above ATTACKS)
    paths: tuple[str, ...] = ("grade", "autograde")
    #: played again by the rootless replay (tests/test_rootless.py): its outcome can depend on running without root
    rootless: bool = False

    def bound(self) -> float:
        """Seconds grading this submission may take, at most."""
        return STARTUP + self.extra


def expected_scores(attack: Attack, source_nb, submission_nb) -> dict[str, float]:
    """{grade_id: points} the honest part of the submission earns."""
    answers = answer_cells(source_nb)
    broken = set()
    for i in attack.broken_answers:
        if i < len(answers):
            broken |= defined_names(answers[i])
    tests = test_cells(source_nb)
    first = tests[0]
    scores = {}
    for test in tests:
        meta = nbgrader_meta(test)
        earned = float(meta.get("points", 0))
        if attack.ungradable or attack.zero or uses(test, broken):
            earned = 0.0
        if attack.fatal and test is not first:
            earned = 0.0
        scores[meta["grade_id"]] = earned
    return scores


# --------------------------------------------------------------------------- the attacks


def _honest(nb, ctx):
    return None


def _deadlock(nb, ctx):
    # ranks 0 and 1 each wait to receive from the other first: neither ever sends
    cell = answer_cells(nb)[1]
    cell.source = re.sub(r"(\n([ \t]*)### BEGIN SOLUTION)", "\n\\2import torch as _t, torch.distributed as _d\n"
                         "\\2if _d.get_rank() < 2:\n\\2    _d.recv(_t.zeros(1), src=1 - _d.get_rank())\\1",
                         cell.source, count=1)


def _sigint_loop(nb, ctx):
    insert_after_first_test(nb, "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                "while True:\n    time.sleep(0.1)")


def _os_exit(nb, ctx):
    insert_after_first_test(nb, "import os\nos._exit(1)")


def _fork_bomb(nb, ctx):
    insert_after_first_test(nb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")


def _memory_hog(nb, ctx):
    insert_after_first_test(nb, "hog = []\nwhile True:\n    hog.append(bytearray(256 << 20))")


def _output_flood(nb, ctx):
    insert_after_first_test(nb, "import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range(100 * 1024):\n"
                                "    sys.stdout.write(line)\nsys.stdout.flush()")


READ_MARK = "ATTACK-READ"


def _read_sources(nb, ctx):
    # look where a grader keeps solutions: the checkout's exercises/, any course folder above us
    insert_after_first_test(nb, f'''
import glob, os, course
repo = os.path.dirname(os.path.dirname(os.path.abspath(course.__file__)))
folders, here = [repo], os.getcwd()
while here != "/":
    here = os.path.dirname(here)
    folders.append(here)
paths = set({ctx.get("secret_paths", [])!r})
for folder in folders:
    for pattern in ("exercises/*/*.ipynb", "source/*/*.ipynb", "gradebook.db", "submitted/*/*/*.ipynb",
                    "*/*.ipynb", "*/*/*.ipynb", ".ddp-course/*/*/*/*/*.ipynb"):
        paths.update(glob.glob(os.path.join(folder, pattern)))
secrets = 0
for path in sorted(paths):
    if os.path.realpath(path).startswith(os.path.realpath(os.getcwd()) + "/"):
        continue  # our own notebook
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        print("{READ_MARK} denied", path, type(exc).__name__)
        continue
    if b"BEGIN HIDDEN TESTS" in data or b"BEGIN SOLUTION" in data or data.startswith(b"SQLite format"):
        secrets += 1
        print("{READ_MARK} SECRET", path, data[:20000].decode(errors="replace"))
    else:
        print("{READ_MARK} public", path)
print("{READ_MARK} secrets read:", secrets)
print("{READ_MARK} kernel process", open("/proc/self/comm").read().strip())  # forked from a zygote, or exec'd
''')


WRITE_MARK = "ATTACK-WRITE"


def _write_gradebook(nb, ctx):
    insert_after_first_test(nb, f'''
import glob, os
targets, here = set({ctx.get("victim_paths", [])!r}), os.getcwd()
while here != "/":
    here = os.path.dirname(here)
    for pattern in ("gradebook.db", "submitted/*/*/*.ipynb", "autograded/*/*/*.ipynb", "*/*.ipynb"):
        targets.update(glob.glob(os.path.join(here, pattern)))
for path in sorted(targets):
    if os.path.realpath(path).startswith(os.path.realpath(os.getcwd()) + "/"):
        continue
    try:
        with open(path, "ab") as fh:
            fh.write(b"pwned")
        print("{WRITE_MARK} wrote", path)
    except OSError as exc:
        print("{WRITE_MARK} denied", path, type(exc).__name__)
for folder in {ctx.get("victim_dirs", [])!r}:
    try:
        with open(os.path.join(folder, "planted.txt"), "w") as fh:
            fh.write("pwned")
        print("{WRITE_MARK} planted in", folder)
    except OSError as exc:
        print("{WRITE_MARK} denied", folder, type(exc).__name__)
''')


NET_MARK = "ATTACK-NET"


def _network(nb, ctx):
    # what the namespace holds (interfaces, routes beyond its loopback), then a connection to each of the
    # listeners on this host's own addresses: only this machine's addresses, so nothing could leave it
    insert_after_first_test(nb, f'''
import socket
print("{NET_MARK} interfaces", sorted(name for _, name in socket.if_nameindex()))
routes = open("/proc/net/route").read().splitlines()[1:]  # IPv4's main table
try:
    routes += [line for line in open("/proc/net/ipv6_route").read().splitlines() if line.split()[-1] != "lo"]
except OSError:  # no IPv6 in this kernel
    pass
print("{NET_MARK} routes", len(routes), routes)
for host, port in {ctx.get("listeners", [])!r}:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("{NET_MARK} CONNECTED", host, port)
    except OSError as exc:
        print("{NET_MARK} blocked", host, port, type(exc).__name__)
''')


LEAK_MARK = "ATTACK-LEAK"


def _leak_history(nb, ctx):
    # record every cell the kernel is given, then print all the kernel remembers of the test cells
    insert_after_imports(nb, """
_seen_cells = []
get_ipython().events.register("pre_run_cell", lambda info: _seen_cells.append(info.raw_cell))
""")
    nb.cells.append(new_code_cell(f'''
import glob, linecache, os
texts = list(_seen_cells) + list(_ih) + list(In)
texts += ["".join(entry[2]) for entry in list(linecache.cache.values()) if len(entry) > 2]
texts += [raw for _, _, raw in get_ipython().history_manager.get_range(raw=True)]
for path in glob.glob("**/*", recursive=True) + glob.glob(".*/**/*", recursive=True):
    try:
        with open(path, errors="replace") as fh:
            texts.append(fh.read(1 << 20))
    except OSError:
        pass
found = sorted({{line.strip() for text in texts for line in str(text).splitlines()
                if "graders." in line or "HIDDEN" in line}})
for line in found:
    print("{LEAK_MARK}", line)
print("{LEAK_MARK} lines:", len(found))
'''))


def _break_all(nb):
    for cell in answer_cells(nb):
        break_answer(cell)


def _patch_graders(nb, ctx):
    _break_all(nb)
    insert_after_imports(nb, '''
import sys, graders
for name, module in list(sys.modules.items()):
    if name.startswith("graders.") and hasattr(module, "__dict__"):
        for attr in dir(module):
            if attr.startswith("check_"):
                setattr(module, attr, lambda *a, _n=attr, **k: print(f"passed {_n}"))
''')


def _patch_launcher(nb, ctx):
    # keep correct copies under other names, hand them to the jobs instead of the (wrong) answers
    source_answers = [c.source for c in answer_cells(nb)]
    _break_all(nb)
    refs = "\n".join(re.sub(r"def (\w+)\(", r"def _ref_\1(", s) for s in source_answers)
    insert_after_imports(nb, refs + '''

import course, course.checks, course.launcher, course.launcher.job
_real_launch = course.launcher.job.launch

def _swapping_launch(fn, world_size, *, args=(), **kw):
    swapped = tuple(globals().get("_ref_" + getattr(a, "__name__", ""), a) if callable(a) else a for a in args)
    return _real_launch(fn, world_size, args=swapped, **kw)

for _module in (course, course.checks, course.launcher, course.launcher.job):
    _module.launch = _swapping_launch
''')


def _patch_assert(nb, ctx):
    _break_all(nb)
    insert_after_imports(nb, '''
import builtins, sys, types
builtins.AssertionError = type("AssertionError", (Exception,), {})
def _swallow(shell, etype, evalue, tb, tb_offset=None):
    print("passed")
get_ipython().set_custom_exc((BaseException,), _swallow)
fake = types.ModuleType("graders.parallelism")
fake.__getattr__ = lambda name: (lambda *a, **k: print(f"passed {name}"))
sys.modules["graders.parallelism"] = sys.modules["graders.parallelism.checks"] = fake
import graders
graders.parallelism = fake
''')


def _forge_dist(nb, ctx):
    # the averaging answer forges torch.distributed in the rank: every all-reduce "done", a 1-rank world
    answer_cells(nb)[1].source = '''def average_gradients(model, world_size):
    """Replace every p.grad of `model` by its average over the ranks (forged: nothing is communicated)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for module in (dist, c10d):
        module.all_reduce = lambda tensor, *args, **kwargs: None
        module.get_world_size = lambda group=None: 1
        module.get_rank = lambda group=None: 0
        module.is_initialized = lambda: True
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
'''


def _plant_modules(nb, ctx):
    # fake graders/course modules and site hooks wherever a Python started later might import from
    _patch_graders(nb, ctx)
    insert_after_imports(nb, '''
import os, site
fake = "def __getattr__(name):\\n    return lambda *a, **k: print('passed', name)\\n"
hook = "import builtins\\nbuiltins.PWNED = True\\n"
for folder in (os.getcwd(), site.getusersitepackages()):
    for package in ("graders", "graders/parallelism", "course", "course/checks"):
        os.makedirs(os.path.join(folder, package), exist_ok=True)
    for name, text in (("graders/__init__.py", ""), ("graders/parallelism/__init__.py", fake),
                       ("graders/parallelism/checks.py", fake), ("course/checks.py", fake),
                       ("course/checks/__init__.py", fake),
                       ("usercustomize.py", hook), ("sitecustomize.py", hook)):
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(text)
    with open(os.path.join(folder, "zz-pwn.pth"), "w") as fh:
        fh.write("import builtins; builtins.PWNED = True\\n")
''')


def insert_after_imports(nb, source: str) -> None:
    """Insert a code cell right after the first code cell (the imports)."""
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first + 1, new_code_cell(source))


def _deleted_tests(nb, ctx):
    nb.cells = [c for c in nb.cells if c not in test_cells(nb)]


def _duplicated_tests(nb, ctx):
    for test in test_cells(nb):
        index = nb.cells.index(test)
        twin = copy.deepcopy(test)
        twin.id = test.id + "-copy" if test.get("id") else None
        twin.source = "print('passed')"  # a forged twin claiming the same grade_id
        again = copy.deepcopy(test)
        if test.get("id"):
            twin["id"], again["id"] = test.id[:50] + "-forged", test.id[:50] + "-again"
        nb.cells.insert(index + 1, twin)
        nb.cells.insert(index + 2, again)


def _split_test(nb, ctx):
    test = test_cells(nb)[0]
    lines = test.source.splitlines()
    test.source = lines[0]
    rest = new_code_cell("\n".join(lines[1:]) or "pass")
    nb.cells.insert(nb.cells.index(test) + 1, rest)


def _renamed(nb, ctx):
    return None


def _invalid_json(nb, ctx):
    text = nbformat.writes(nb)
    return text[: len(text) // 2].encode()


# --------------------------------------------------------------------------- where each attack is played
#
# Issue 38: each attack is played only on the paths where its outcome can differ (the root run), and again
# without root (tests/test_rootless.py) only where running without root can change it.
#
# What decides an outcome, and which path runs it:
# * both paths run the same code for: the sandbox's isolation (course.sandbox.wrapper: namespaces, rlimits,
#   cgroup, uid; the same functions whether the wrapper was exec'd, on grade, or forked from the autograde
#   worker's zygote and run in place), SandboxedExecute/GuardedExecution (cell time limits, the interrupt and
#   its grace, the cap on a cell's output), VerifyTests and the verifier (the checks re-run in a trusted
#   process), the launcher (a job's deadline, the stall detector, killing the ranks), the graders' checks,
#   nbgrader's LimitOutput (pipeline.GRADING_STEPS, the one list both paths run);
# * grade alone: reading the notebook (notebook.read), locked cells restored from the source notebook
#   (restore.restore), the work folder a copy of the submission's folder (copy_submission), the exercises
#   folder it was given hidden, the kernel and the verifier exec'd afresh (jupyter_client's Popen), scoring by
#   score_notebook (a cell that never ran scores 0 through Execution.ran). Played through grade_notebook, so
#   exec'd: the `ddp-course grade` and `check` commands fork both from a zygote of their own (one_zygote),
#   which is the autograde worker's code (Zygote, ZygoteProcess, the wrapper run in place), played there;
# * autograde alone: nbgrader's autograde (reading and validating the notebook, restoring locked cells from
#   the gradebook, SaveAutoGrades scoring from the outputs), the kernel and the verifier forked from the
#   worker's zygote (which preloaded torch, course.checks and the launcher; the kernel's process is a
#   ZygoteProcess, with its own poll, signal and kill), the pool's per-submission deadline and kill_tree,
#   the course folder hidden (gradebook.db, source/, every student's submitted/), the record, the merge into
#   the gradebook, feedback.
# What running without root changes (the rootless sandbox): a user namespace instead of a uid of its own (the
# sandbox runs as the grader's own uid), no cgroups (RLIMIT_AS for memory, RLIMIT_NPROC and a pid namespace
# for processes), mounts made inside the user namespace, processes killed with the namespace's init. The replay
# plays the grade path with its kernel and verifier forked from a zygote (runs.forked_from_a_zygote), as
# `ddp-course grade` and autograde run them for an instructor without root; the root run plays both kinds.
#
# attack            paths      rootless  why
# honest            both       yes   the control: every path, and the rootless sandbox, must give it every point
# deadlock          autograde  yes   stopped by the launcher in the verifier and the kernel (stall detector, a
#                                    job's deadline, the ranks killed): the same code on both paths; it only
#                                    changes an answer cell, which both paths keep as written (every other
#                                    attack shows that on both). Without root its ranks die with the pid namespace
# sigint_loop       both       yes   its kernel is stopped after the grace through the kernel's process (Popen
#                                    on grade, ZygoteProcess on autograde) and the cells after it are scored by
#                                    each path's own scorer. Without root: killed through the namespace's init
# os_exit           both       yes   the death is noticed through the kernel's process (Popen / ZygoteProcess.poll)
#                                    and the cells after it score 0 by score_notebook / SaveAutoGrades. Without
#                                    root the kernel is a child of the namespace's init, whose exit must still show
# fork_bomb         both       yes   as sigint_loop; contained by the pids cgroup and a uid-wide kill as root, by
#                                    RLIMIT_NPROC and the pid namespace without
# memory_hog        both       yes   as os_exit (an OOM kill noticed through the kernel's process); without root
#                                    RLIMIT_AS stops it instead of the memory cgroup (another expected outcome)
# output_flood      autograde  no    cut in the grading process by GuardedExecution's output cap, the same on both
#                                    paths, before either saves or scores the notebook; the kernel prints through
#                                    ipykernel's messages, which the sandbox kind does not touch
# read_sources      both       yes   what is hidden and what it looks for differ by path (the exercises folder on
#                                    grade; the course folder, gradebook and other students on autograde).
#                                    Without root the covering mounts are made in a user namespace
# write_gradebook   both       yes   its targets differ by path (the gradebook and the other students' folders
#                                    exist on autograde alone). Without root there is no sandbox uid: only the
#                                    read-only mounts stop it
# network           autograde  yes   stopped by the wrapper's network namespace (wrapper._isolate), the same
#                                    function on both paths (autograde runs it forked from the zygote; the exec'd
#                                    wrapper is tested by test_sandbox.py::test_network_is_only_the_namespace_loopback).
#                                    Without root the namespace is made in a user namespace (the replay plays grade)
# leak_history      both       yes   what the kernel is given and its work folder differ by path (restore and a
#                                    copied folder / nbgrader's autograded/ folder), and autograde's feedback page.
#                                    Without root it reads files as the grader's own uid
# patch_graders     both       no    patches the graders in the kernel, which starts differently by path (exec'd /
#                                    forked from a zygote that preloaded course.checks and the launcher: what its
#                                    loop finds differs), and has a feedback page on autograde. Without root
#                                    nothing differs for it: the patch stays in the kernel's memory
# patch_launcher    both       no    as patch_graders (the launcher it replaces is preloaded on autograde)
# patch_assert      both       no    as patch_graders (sys.modules and IPython's handler of a kernel started either way)
# forge_dist        autograde  no    forges torch.distributed in the verifier's ranks and is judged by the check
#                                    from its effects (the gradients): the graders and the launcher, the same on
#                                    both paths; it only changes an answer cell. In memory: root does not matter
# plant_modules     both       yes   plants modules where a Python started later imports from: the verifier is a
#                                    fresh `python -s -P` on grade, forked with everything imported on autograde.
#                                    Without root the sandbox has the grader's own uid, and so its site-packages
# deleted_tests     both       no    restore vs nbgrader's gradebook (different outcomes); no sandbox decides it
# duplicated_tests  both       no    restore vs nbgrader's validation (different outcomes); no sandbox decides it
# split_test        both       no    restore vs nbgrader's restoring of locked cells; no sandbox decides it
# renamed           both       no    matched by grade_ids vs by file name (different outcomes); before any sandbox
# invalid_json      both       no    notebook.read vs nbgrader's reader; it never reaches a sandbox
#
# The waits: deadlock, sigint_loop, fork_bomb and memory_hog spend most of their time waiting on a limit
# (the stall detector or CHECK_TIMEOUT, CELL_TIMEOUT + the interrupt's grace). Those waits are idle: the other
# submissions graded alongside use the cores meanwhile (3 at a time on 2 cores), so shortening them would save
# little CPU, the suite's bottleneck; and CELL_TIMEOUT and CHECK_TIMEOUT also bound the honest cells and jobs of
# every submission on a loaded machine, where less would fail honest work.

ONE_PATH = ("autograde",)  # where the attacks whose outcome cannot differ by path are played: the cheaper path


ATTACKS = [
    Attack("honest", _honest, "nothing to stop: the control submission", message="",
           rootless=True),
    Attack("deadlock", _deadlock, "the stall watch: every rank idle in recv, named within seconds (kernel and "
           "verifier)", broken_answers=(1,), message=r"deadlocked: rank 0 waits in recv", extra=4 * CHECK_TIMEOUT,
           paths=ONE_PATH, rootless=True),
    Attack("sigint_loop", _sigint_loop, "cell timeout, then the kernel is stopped when the interrupt is ignored",
           fatal=True, message=r"did not stop when\s+interrupted", extra=CELL_TIMEOUT + GRACE,
           rootless=True),
    Attack("os_exit", _os_exit, "the dead kernel costs only the cells after it", fatal=True,
           message=r"kernel died",
           rootless=True),
    Attack("fork_bomb", _fork_bomb, "RLIMIT_NPROC/pids cgroup, cell timeout, uid-wide kill", fatal=True,
           survivable=True, message=r"did not stop when\s+interrupted|kernel died|CellTimeoutError",
           extra=CELL_TIMEOUT + GRACE,
           rootless=True),
    # without root there is no memory cgroup: RLIMIT_AS makes the allocation fail (MemoryError in the cell) and
    # the rest runs; the grader is unharmed either way, and the score is the honest part. With the cgroup (v1),
    # the kernel is usually OOM-killed; under load it may instead thrash at the limit (the cgroup reclaims the
    # kernel's own file-backed pages, torch's libraries) until the cell's time limit interrupts it, and then the
    # tests after it run honestly (seen once in CI: "cell timed out after 15 s", the rest scored as the reference)
    Attack("memory_hog", _memory_hog, "memory cgroup: the kernel is killed (without root: RLIMIT_AS, MemoryError)",
           fatal=ROOT, survivable=ROOT,
           message=r"kernel died|did not stop|CellTimeoutError" if ROOT else "", extra=CELL_TIMEOUT + GRACE,
           rootless=True),
    Attack("output_flood", _output_flood, "output capped per cell, the rest dropped",
           message=r"printed more than \d+ MB", extra=60,
           paths=ONE_PATH),
    Attack("read_sources", _read_sources, "mount namespace: sources and course folder covered by empty tmpfs",
           message="",
           rootless=True),
    Attack("write_gradebook", _write_gradebook, "mount namespace (read-only empty tmpfs) and the sandbox uid",
           message="",
           rootless=True),
    Attack("network", _network, "network namespace with only loopback: no interface, no route, "
           "none of the host's own addresses", message="",
           paths=ONE_PATH, rootless=True),
    Attack("leak_history", _leak_history, "the kernel never gets hidden tests (the verifier runs them); "
           "feedback redacts test cells", message="",
           rootless=True),
    Attack("patch_graders", _patch_graders, "verifier re-runs the real checks in a trusted process",
           broken_answers=(0, 1, 2, 3, 4, 5), message=r"FAILED check_"),
    Attack("patch_launcher", _patch_launcher, "verifier: the kernel's launcher is not the verifier's",
           broken_answers=(0, 1, 2, 3, 4, 5), message=r"FAILED check_"),
    Attack("patch_assert", _patch_assert, "verifier: AssertionError, sys.modules and IPython's handler stay in the kernel",
           broken_answers=(0, 1, 2, 3, 4, 5), message=r"FAILED check_"),
    Attack("forge_dist", _forge_dist, "checks judge effects (the gradients after averaging), not what "
           "torch.distributed's functions say", broken_answers=(1,), message=r"still this rank's own gradient",
           paths=ONE_PATH),
    Attack("plant_modules", _plant_modules, "verifier runs python -s -P with a fresh home: nothing imported from "
           "the work folder or the user's site-packages", broken_answers=(0, 1, 2, 3, 4, 5),
           message=r"FAILED check_",
           rootless=True),
    Attack("deleted_tests", _deleted_tests, "grade: locked cells restored from the source; autograde: nbgrader "
           "scores the missing test cells 0", message="",
           per_path={"autograde": dict(zero=True)}),
    Attack("duplicated_tests", _duplicated_tests, "grade: restore keeps the first copy of a grade_id; autograde: "
           "nbgrader rejects the notebook (one error, 0, the run goes on)", message="",
           per_path={"autograde": dict(ungradable=True, message=r"[Ss]chema|duplicate|failed")}),
    Attack("split_test", _split_test, "restore replaces the test cell; the stray half is the student's cell",
           message=""),
    Attack("renamed", _renamed, "grade: matched to its source by grade_ids; autograde: reported as missing",
           file_name="my_parallelism_v2.ipynb",
           per_path={"autograde": dict(ungradable=True, message=r"no parallelism\.ipynb|no \w+\.ipynb")}),
    Attack("invalid_json", _invalid_json, "reading fails cleanly: one error, no score, the run goes on",
           ungradable=True, message=r"not a readable notebook|not valid|failed|JSON|Unterminated|Expecting"),
]
BY_NAME = {a.name: a for a in ATTACKS}
#: "rootless": play only the attacks marked ``rootless``, on whichever paths the run plays (tests/test_rootless.py)
PLAY_ENV = "DDP_COURSE_ADVERSARIAL_PLAY"


def played(path: str) -> list[Attack]:
    """The attacks graded on ``path`` ("grade" or "autograde") in this run: each on its :attr:`Attack.paths`;
    in the rootless replay (``DDP_COURSE_ADVERSARIAL_PLAY=rootless``) the ``rootless`` ones, on every path it plays
    (the sandbox without root is what it tests; the root run plays each attack on the paths where it can differ)."""
    if os.environ.get(PLAY_ENV, "") == "rootless":
        return [a for a in ATTACKS if a.rootless]
    return [a for a in ATTACKS if path in a.paths]


def for_path(attack: Attack, path: str) -> Attack:
    """The attack as expected on one grading path ("grade" or "autograde")."""
    override = attack.per_path.get(path)
    if not override:
        return attack
    return Attack(**{**attack.__dict__, **override, "per_path": {}})


def build(attack: Attack, source_nb, ctx: dict) -> tuple[bytes, NotebookNode]:
    """(the submission's bytes, the notebook before serialising) for ``attack`` on ``source_nb``."""
    nb = strip_hidden_tests(source_nb)
    for cell in nb.cells:  # a student's copy, as handed in: no outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    raw = attack.build(nb, ctx)
    if raw is None:
        raw = nbformat.writes(nb).encode()
    return raw, nb
