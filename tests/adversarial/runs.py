"""Grade the attack submissions once per session, on both grading paths, and keep what happened.

Each path grades the attacks :func:`attacks.played` gives it: every attack on the paths where its outcome
can differ (:attr:`attacks.Attack.paths`; the table above ``attacks.ATTACKS`` says why for each).

(conftest.py turns :func:`grade_batch` and :func:`autograde_batch` into session fixtures.)

* ``grade`` path: :func:`course.grading.grade.grade_notebook`, what ``ddp-course grade`` runs
  (restore the locked cells, run in a sandboxed kernel, re-run the checks in the
  trusted verifier, score by nbgrader's rules); 3 submissions at a time.
* ``autograde`` path: ``ddp-course init``, ``release``, then ``ddp-course autograde
  --jobs 3`` with the nbgrader_config.py ``init`` wrote (its
  :data:`course.grading.pipeline.GRADING_STEPS`, the steps ``grade`` runs too);
  every attack played there is one student, graded in the same run as an honest one; then
  ``ddp-course feedback`` for the students whose pages must show no hidden test.

The base is exercise 1's source notebook (DDP_COURSE_ADVERSARIAL_BASE=tiny: the
small exercise in tests/files/verify, about twice as fast).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import attacks
import nbformat

ROOT = Path(__file__).resolve().parents[2]
BASES = {
    "ex1": ROOT / "exercises" / "ex1-parallelism" / "parallelism.ipynb",
    "tiny": ROOT / "tests" / "files" / "verify" / "ex0-verify" / "parallelism.ipynb",
}
#: the sandbox uids the attacks' graders take (root): a part of the sandbox's range no other test uses
#: (tests/conftest.py gives the rest the lower part), so the leftovers found there are the attacks' own even
#: while another xdist worker grades
ATTACK_UIDS = range(61400, 61512)
ENV = {"DDP_COURSE_CHECK_TIMEOUT": str(attacks.CHECK_TIMEOUT),
       "DDP_COURSE_SANDBOX_UIDS": f"{ATTACK_UIDS.start}-{ATTACK_UIDS.stop - 1}"}
#: students whose feedback pages the autograde path generates and checks for hidden tests
FEEDBACK_STUDENTS = ("honest", "leak_history", "patch_graders")
PARALLEL = 3


def base_path() -> Path:
    choice = os.environ.get("DDP_COURSE_ADVERSARIAL_BASE", "ex1")
    path = BASES[choice]
    return path if path.is_file() else BASES["tiny"]


@dataclass
class Outcome:
    """What grading one submission gave, on one path."""

    scores: dict[str, float] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    #: report-level text: sandbox summary, disagreements, the error of an ungradable submission
    notes: list[str] = field(default_factory=list)
    #: all outputs of the graded notebook as text (what the student and the instructor get to see)
    outputs: str = ""
    elapsed: float = 0.0
    error: str = ""

    def text(self) -> str:
        return "\n".join([*self.messages.values(), *self.notes, self.error, self.outputs])

    def brief(self) -> str:
        """For a failed assertion: each test's message, the notes and the error first, then the outputs' end."""
        head = [f"{gid}: {self.scores.get(gid)}: {message[:1500]}" for gid, message in self.messages.items()]
        return "\n".join([*head, *self.notes, self.error, "--- outputs (end):", self.outputs[-1500:]])


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(str(out.get("text", "")) + str(out.get("evalue", "")) + "\n".join(out.get("traceback", [])))
    return "\n".join(parts)


class Listener:
    """TCP servers on this machine that count connections (sandboxed code must make none).

    They listen on every IPv4 address, and on every IPv6 one where the host has IPv6. The targets
    (:meth:`addresses`) are this host's loopback, which a sandbox's own namespace does not share, and
    each address of the host's own interfaces, read with psutil (nothing is sent to find them). So no
    target is another machine's: were the isolation ever broken, no packet would leave this host.
    """

    def __init__(self):
        self.socks = [self._listen(socket.AF_INET, "0.0.0.0")]
        if socket.has_ipv6:
            try:
                self.socks.append(self._listen(socket.AF_INET6, "::"))
            except OSError:  # IPv6 off on this host: nothing to reach over it either
                pass
        self.ports = {s.family: s.getsockname()[1] for s in self.socks}
        self.port = self.ports[socket.AF_INET]
        self.accepted = 0
        self._lock = threading.Lock()  # two accepting threads count
        self._stop = False
        self._targets: list[tuple[str, int]] | None = None
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in self.socks]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _listen(family, address: str) -> socket.socket:
        sock = socket.socket(family)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, 0))
        sock.listen(16)
        sock.settimeout(0.5)
        return sock

    def _serve(self, sock):
        while not self._stop:
            try:
                conn, _ = sock.accept()
                with self._lock:
                    self.accepted += 1
                conn.close()
            except OSError:
                continue

    def addresses(self) -> list[tuple[str, int]]:
        """(address, port) for the host's loopback and each of its own non-loopback addresses.

        Each is first connected to from here, outside any sandbox: a target this process cannot reach
        would make "blocked" in a sandbox prove nothing, so it fails the run. The count starts at 0 after.
        """
        if self._targets is None:
            targets = [("127.0.0.1", self.port)]
            if socket.AF_INET6 in self.ports:
                targets.append(("::1", self.ports[socket.AF_INET6]))
            targets += [(a, self.ports[f]) for a, f in host_addresses() if f in self.ports]
            for target in targets:
                socket.create_connection(target, timeout=5).close()
            end = time.monotonic() + 10
            while self.accepted < len(targets) and time.monotonic() < end:
                time.sleep(0.05)
            with self._lock:
                assert self.accepted == len(targets), f"the listener took {self.accepted} of {targets}"
                self.accepted = 0
            self._targets = targets
        return self._targets

    def beyond_loopback(self) -> list[tuple[str, int]]:
        """The targets that are not loopback (none on a host whose only interface is ``lo``)."""
        return [t for t in self.addresses() if not is_loopback(t[0])]

    def close(self):
        self._stop = True
        for sock in self.socks:
            sock.close()


def is_loopback(address: str) -> bool:
    return address == "::1" or address.startswith("127.")


def host_addresses() -> list[tuple[str, int]]:
    """(address, family) of this host's own interfaces, loopback and scoped (link-local) IPv6 left out."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and "%" not in addr.address \
                    and not is_loopback(addr.address) and (addr.address, addr.family) not in found:
                found.append((addr.address, addr.family))
    return found


def full_sandbox() -> bool:
    """Whether submissions run fully isolated here (root, namespaces allowed)."""
    from course.sandbox import namespaces_available

    return namespaces_available()[0]


def sandbox_kind() -> str:
    """"full" (root: a uid, cgroup and namespaces per submission), "rootless" (a user namespace) or "partial"."""
    from course.sandbox import rootless_available

    return "full" if full_sandbox() else "rootless" if rootless_available()[0] else "partial"


def sandbox_processes() -> list[int]:
    """Processes still running as one of the attacks' sandbox uids (root) or carrying a sandbox's marker (not
    root: only this user's own processes can be read)."""
    from course.sandbox import TOKEN_ENV

    if os.geteuid() == 0:
        return _scan_uids(set(ATTACK_UIDS))
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as fh:
                    if f"{TOKEN_ENV}=".encode() in fh.read():
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def leftovers(within: float = 30.0) -> list[int]:
    """Sandbox processes still there after ``within`` seconds (SIGKILLed processes take a moment to go,
    longer on a loaded machine)."""
    end = time.monotonic() + within
    while True:
        found = sandbox_processes()
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.5)


def _scan_uids(uids) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as fh:
                    for line in fh:
                        if line.startswith(b"Uid:"):
                            if int(line.split()[1]) in uids:
                                found.append(int(entry.name))
                            break
            except OSError:
                pass
    return found


def file_digest(paths) -> dict[str, str]:
    out = {}
    for path in paths:
        p = Path(path)
        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
    return out


# --------------------------------------------------------------------------- the grade path


def forked_from_a_zygote():
    """Where ``DDP_COURSE_ADVERSARIAL_FORK=1`` (the rootless replay, tests/test_rootless.py): the grade path's kernels
    and verifiers forked from one zygote, as ``ddp-course grade`` (:func:`course.grading.grade.one_zygote`) and
    ``autograde`` run them for an instructor without root; else nothing (the root run: exec'd, below)."""
    import contextlib

    from course.grading.grade import one_zygote

    return one_zygote() if os.environ.get("DDP_COURSE_ADVERSARIAL_FORK") == "1" else contextlib.nullcontext()


def grade_one(path: Path, exercises: Path) -> Outcome:
    """``ddp-course grade`` on ``path``: :func:`course.grading.grade.grade_notebook`, the CLI's own entry point,
    called here without the zygote the CLI starts around it (:func:`course.grading.grade.one_zygote`) unless
    :func:`forked_from_a_zygote`: its kernel and verifier exec'd, as the API, ``DDP_COURSE_ZYGOTE=0`` and a machine
    where a zygote cannot start run them (processes forked from a zygote are the autograde path's, played there)."""
    import tempfile

    from course.grading.grade import grade_notebook
    from course.grading.notebook import NotebookError, Timeouts

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="graded-") as folder:
        graded = Path(folder) / "graded.ipynb"
        try:
            report = grade_notebook(path, exercises=exercises, output=graded,
                                    timeouts=Timeouts(test=attacks.TEST_TIMEOUT, other=attacks.CELL_TIMEOUT))
        except NotebookError as err:
            return Outcome(error=str(err), elapsed=time.monotonic() - started)
        nb = nbformat.read(str(graded), as_version=4)
    return Outcome({t.id: t.score for t in report.tests}, {t.id: t.message for t in report.tests},
                   list(report.notes), outputs_text(nb), time.monotonic() - started)


@dataclass
class Batch:
    """Every attack graded on one path."""

    outcomes: dict[str, Outcome]
    source: nbformat.NotebookNode
    submissions: dict[str, nbformat.NotebookNode]
    listener_connections: int
    victims_before: dict[str, str]
    victims_after: dict[str, str]
    leftovers: list[int]
    elapsed: float
    extra: dict = field(default_factory=dict)
    #: what the network attack was aimed at: (address, port) on this host (see :class:`Listener`)
    network_targets: list = field(default_factory=list)


def _context(listener: Listener, secret_paths, victim_paths, victim_dirs) -> dict:
    return {"listeners": listener.addresses(), "secret_paths": [str(p) for p in secret_paths],
            "victim_paths": [str(p) for p in victim_paths], "victim_dirs": [str(p) for p in victim_dirs]}


def grade_batch(tmp_path_factory) -> Batch:
    root = tmp_path_factory.mktemp("grade")
    exercises = root / "exercises"  # a copy: the sources an attack may try to read or overwrite
    shutil.copytree(base_path().parent, exercises / base_path().parent.name)
    base = exercises / base_path().parent.name / base_path().name
    source = nbformat.read(str(base), as_version=4)
    listener = Listener()
    honest_dir = root / "honest" / base.parent.name
    victim_paths = [honest_dir / base.name, base]
    ctx = _context(listener, [base, base_path()], victim_paths, [honest_dir, base.parent])
    paths, submissions = {}, {}
    for attack in attacks.played("grade"):
        raw, nb = attacks.build(attack, source, ctx)
        folder = root / attack.name / base.parent.name
        folder.mkdir(parents=True)
        path = folder / (attack.file_name or base.name)
        path.write_bytes(raw)
        paths[attack.name], submissions[attack.name] = path, nb
    before = file_digest(victim_paths)
    started = time.monotonic()
    old_env = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        with forked_from_a_zygote(), ThreadPoolExecutor(PARALLEL) as pool:
            futures = {name: pool.submit(grade_one, path, exercises) for name, path in paths.items()}
            outcomes = {}
            for name, future in futures.items():
                try:
                    outcomes[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - recorded: the test for that attack fails with it
                    outcomes[name] = Outcome(error=f"grading crashed: {type(exc).__name__}: {exc}")
    finally:
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    elapsed = time.monotonic() - started
    time.sleep(1)
    listener.close()
    return Batch(outcomes, source, submissions, listener.accepted, before, file_digest(victim_paths),
                 leftovers(), elapsed, network_targets=ctx["listeners"])


# --------------------------------------------------------------------------- the autograde path

def _gradebook_scores(course_dir: Path, assignment: str, student: str) -> dict[str, float] | None:
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{course_dir / 'gradebook.db'}", "ddp-course") as gb:
        try:
            submission = gb.find_submission(assignment, student)
        except MissingEntry:
            return None
        return {g.name: float(g.score) for nb in submission.notebooks for g in nb.grades if g.cell.cell_type == "code"
                and g.max_score}


def autograde_batch(tmp_path_factory) -> Batch:
    import json

    base = base_path()
    assignment = base.parent.name
    source = nbformat.read(str(base), as_version=4)
    root = tmp_path_factory.mktemp("autograde")
    exercises = root / "exercises"
    # the attacked notebook and the files it may need, not the assignment's other notebooks: every submission
    # is one notebook, and its scores are that notebook's test cells
    shutil.copytree(base.parent, exercises / assignment,
                    ignore=lambda folder, names: [n for n in names if n.endswith(".ipynb") and n != base.name])
    course_dir = root / "course"
    env = {**os.environ, **ENV}
    subprocess.run(["ddp-course", "init", str(course_dir), "--exercises", str(exercises),
                    "--test-timeout", str(attacks.TEST_TIMEOUT), "--cell-timeout", str(attacks.CELL_TIMEOUT)],
                   check=True, capture_output=True, env=env, timeout=300)
    subprocess.run(["ddp-course", "release"], cwd=course_dir, check=True, capture_output=True, env=env, timeout=300)
    listener = Listener()
    honest_dir = course_dir / "submitted" / "honest" / assignment
    secret = [course_dir / "source" / assignment / base.name, exercises / assignment / base.name]
    victim_paths = [honest_dir / base.name, course_dir / "gradebook.db", *secret]
    ctx = _context(listener, [*secret, base], victim_paths, [honest_dir, course_dir / "submitted"])
    submissions = {}
    for attack in attacks.played("autograde"):
        raw, nb = attacks.build(attack, source, ctx)
        folder = course_dir / "submitted" / attack.name / assignment
        folder.mkdir(parents=True)
        (folder / (attack.file_name or base.name)).write_bytes(raw)
        submissions[attack.name] = nb
    watched = [honest_dir / base.name, *secret]
    before = file_digest(watched)
    started = time.monotonic()
    proc = subprocess.run(["ddp-course", "autograde", "--jobs", str(PARALLEL), "--timeout", "900"], cwd=course_dir,
                          capture_output=True, text=True, env=env, timeout=1500)
    elapsed = time.monotonic() - started
    time.sleep(1)
    listener.close()
    outcomes = {}
    for attack in attacks.played("autograde"):
        student = attack.name
        record_path = course_dir / ".ddp-course" / "autograde" / assignment / f"{student}.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        scores = _gradebook_scores(course_dir, assignment, student) if record.get("status") == "graded" else None
        graded = course_dir / "autograded" / student / assignment / base.name
        nb = nbformat.read(str(graded), as_version=4) if graded.is_file() else None
        messages = {}
        if nb is not None:
            for cell in nb.cells:
                gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
                if cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
                    messages[gid] = outputs_text(nbformat.v4.new_notebook(cells=[cell]))
        outcomes[student] = Outcome(scores or {}, messages, [record.get("reason", "")],
                                    outputs_text(nb) if nb is not None else "", float(record.get("elapsed") or 0),
                                    "" if record.get("status") == "graded" else f"{record.get('status')}: "
                                    f"{record.get('reason', '')}")
    left = leftovers()
    # feedback pages of the students who try to read hidden tests back (plus the control)
    readers = [a.name for a in attacks.played("autograde") if a.name in FEEDBACK_STUDENTS]
    feedback = subprocess.run(["ddp-course", "feedback", *(f"--student={s}" for s in readers)], cwd=course_dir,
                              capture_output=True, text=True, env=env, timeout=600)
    pages = {s: "\n".join(p.read_text(errors="replace") for p in
                          sorted((course_dir / "feedback" / s / assignment).glob("*.html"))) for s in readers}
    return Batch(outcomes, source, submissions, listener.accepted, before, file_digest(watched),
                 left, elapsed, extra={"stdout": proc.stdout, "stderr": proc.stderr,
                                       "returncode": proc.returncode, "course_dir": course_dir,
                                       "feedback": feedback, "feedback_pages": pages},
                 network_targets=ctx["listeners"])
