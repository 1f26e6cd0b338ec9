"""The zygote (course.sandbox.zygote): processes forked warm behave as the processes Popen would exec.

What the autograde workers build on it (kernels and verifiers forked, sandboxed as before)
is graded end to end by test_instructor.py and the adversarial suite's autograde path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from course.sandbox import zygote as zygotes

pytestmark = pytest.mark.timeout(180)

#: a module the zygote can run in place: what it sees of itself, as JSON on stdout
_PROBE = textwrap.dedent('''
    import json, multiprocessing, os, random, sys
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("PROBE_VALUE"),
        "torch_preloaded": "torch" in sys.modules, "name": __name__, "fds": fds,
        "ppid": os.getppid(), "sid": os.getsid(0) == os.getpid(),
        "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\\0")[:3],
        "comm": open("/proc/self/comm").read().strip(),
        "random": random.random(), "authkey": bytes(multiprocessing.current_process().authkey).hex(),
        "secret": getattr(sys.modules.get("course.sandbox.zygote"), "SECRET", None),
    }))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
''')


@pytest.fixture(scope="module")
def zygote():
    z = zygotes.Zygote(preload=("torch", "course.sandbox.wrapper"))
    yield z
    z.close()


@pytest.fixture
def probe_dir(tmp_path):
    (tmp_path / "zprobe.py").write_text(_PROBE)
    return tmp_path


def _run(zygote, argv, cwd, **env):
    proc = zygote.popen(argv, env={**os.environ, **env}, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    return proc, out.decode(), err.decode()


def test_a_module_of_this_python_is_forked_warm_and_sees_what_a_fresh_interpreter_would(zygote, probe_dir):
    proc, out, err = _run(zygote, [sys.executable, "-m", "zprobe", "a", "b"], probe_dir, PROBE_VALUE="v", PROBE_EXIT="3")
    assert proc.returncode == 3, err
    seen = json.loads(out)
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["a", "b"] and seen["argv"][0].endswith("zprobe.py")
    assert seen["cwd"] == str(probe_dir) and seen["path0"] == str(probe_dir)  # `python -m` puts the folder first
    assert seen["env"] == "v"
    assert seen["torch_preloaded"]  # forked from the zygote, not exec'd
    assert seen["ppid"] == zygote.pid and seen["sid"]  # a session of its own, as start_new_session gives
    assert seen["comm"] == "zprobe"
    assert seen["fds"] == [0, 1, 2, 3]  # stdin, stdout, stderr (3: the listing's own): none of the zygote's
    assert seen["secret"] is None  # a zygote that reports to nobody draws no secret


def test_two_children_do_not_share_random_state_or_authkey(zygote, probe_dir):
    seen = [json.loads(_run(zygote, [sys.executable, "-m", "zprobe"], probe_dir)[1]) for _ in range(2)]
    assert seen[0]["random"] != seen[1]["random"]
    assert seen[0]["authkey"] != seen[1]["authkey"]


def test_safe_path_keeps_the_folder_off_sys_path(zygote, probe_dir):
    proc, out, err = _run(zygote, [sys.executable, "-s", "-P", "-m", "zprobe"], probe_dir)
    assert proc.returncode == 1 and "No module named zprobe" in err  # as `python -s -P -m zprobe` there says


@pytest.mark.parametrize("why", ["other program", "python -c", "import-time environment differs"])
def test_anything_else_is_really_exec_d(zygote, probe_dir, why):
    if why == "other program":
        proc, out, err = _run(zygote, ["/bin/sh", "-c", "cat /proc/$$/cmdline | tr '\\0' ' '"], probe_dir)
        assert out.startswith("/bin/sh -c"), out
        return
    argv = ([sys.executable, "-c", "import sys; print('torch' in sys.modules)"] if why == "python -c" else
            [sys.executable, "-m", "zprobe"])
    extra = {"PYTHONWARNINGS": "error::RuntimeWarning"} if why != "python -c" else {}
    proc, out, err = _run(zygote, argv, probe_dir, **extra)
    assert proc.returncode == 0, err
    if why == "python -c":
        assert out.strip() == "False"
    else:  # read when the preloaded modules were imported: a fresh interpreter must read it again
        assert json.loads(out)["torch_preloaded"] is False


def test_kill_poll_wait_and_a_dying_zygote(probe_dir):
    z = zygotes.Zygote(preload=())
    try:
        proc = z.popen(["/bin/sleep", "60"])
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
        proc.kill()  # already gone: harmless
        survivor = z.popen(["/bin/sleep", "60"])
        os.kill(z.pid, signal.SIGKILL)
        assert survivor.wait(10) == -signal.SIGKILL  # its zygote gone, nothing can say how it ended: counted killed
        os.kill(survivor.pid, signal.SIGKILL)
    finally:
        z.close()


def test_communicate_times_out_then_reads_the_rest(zygote, probe_dir):
    proc = zygote.popen(["/bin/sh", "-c", "read x; echo got $x; sleep 1; echo late >&2"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(b"hello\n", timeout=0.3)
    out, err = proc.communicate()
    assert (out, err, proc.returncode) == (b"got hello\n", b"late\n", 0)


def test_current_restarts_a_dead_zygote_and_none_means_popen(monkeypatch):
    monkeypatch.setattr(zygotes, "_current", None)
    proc = zygotes.popen(["/bin/true"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(10) == 0
    z = zygotes.Zygote(preload=())
    try:
        zygotes.use(z)
        os.kill(z.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while z.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        fresh = zygotes.current()
        assert fresh is not z and fresh.alive()
        assert zygotes.popen(["/bin/true"]).wait(10) == 0
        fresh.close()
    finally:
        zygotes.use(None)


def test_a_zygote_on_demand_starts_with_its_first_process_and_stops_at_the_end(monkeypatch):
    """What `ddp-course grade` and `check` use: nothing started until a process is asked for (a command that
    fails first pays no imports), one zygote for every process after, gone at the end; nothing at all where
    zygotes are off or one is in use already."""
    monkeypatch.setattr(zygotes, "_current", None)
    monkeypatch.delenv("DDP_COURSE_ZYGOTE", raising=False)
    with zygotes.on_demand(()):
        assert zygotes._current is None  # nothing asked yet: nothing started
    assert zygotes.current() is None
    with zygotes.on_demand(()):
        first = zygotes.current()
        assert first is not None and first.alive() and zygotes.current() is first
        assert zygotes.popen(["/bin/true"]).wait(10) == 0
    assert zygotes.current() is None
    deadline = time.monotonic() + 10
    while first.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not first.alive()
    monkeypatch.setenv("DDP_COURSE_ZYGOTE", "0")
    with zygotes.on_demand(()):
        assert zygotes.current() is None
    monkeypatch.delenv("DDP_COURSE_ZYGOTE")
    mine = zygotes.Zygote(preload=())
    try:
        zygotes.use(mine)
        with zygotes.on_demand(()):
            assert zygotes.current() is mine
        assert zygotes.current() is mine  # not the context's to stop
    finally:
        zygotes.use(None)
        mine.close()


def test_a_reporting_zygote_says_its_pid_then_each_childs_pid_rank_and_secret(probe_dir):
    """With report_fd (torchrun's agents give one: course.launcher.torchrun.agent), the zygote says who it is, then
    the pid and RANK of each process it forks ('-' without one) and the secret it drew for that process alone
    (which the process finds as course.sandbox.zygote.SECRET), on a pipe its children do not hold."""
    read, write = os.pipe()
    z = zygotes.Zygote(preload=(), report_fd=write)
    os.close(write)
    try:
        ranked = z.popen([sys.executable, "-m", "zprobe"], env={**os.environ, "RANK": "5"}, cwd=str(probe_dir),
                         stdout=subprocess.PIPE)
        unranked = z.popen(["/bin/sh", "-c", "ls /proc/self/fd"], env={k: v for k, v in os.environ.items()
                                                                     if k != "RANK"}, stdout=subprocess.PIPE)
        other = z.popen([sys.executable, "-m", "zprobe"], env={**os.environ, "RANK": "6"}, cwd=str(probe_dir),
                        stdout=subprocess.PIPE)
        fds, _ = unranked.communicate(timeout=60)
        assert sorted(fds.split()) == [b"0", b"1", b"2", b"3"]  # 3: the ls's own listing; not the report pipe
        seen = [json.loads(child.communicate(timeout=120)[0]) for child in (ranked, other)]
    finally:
        z.close()
    lines = b""
    while chunk := os.read(read, 4096):
        lines += chunk
    os.close(read)
    said = [line.split() for line in lines.decode().splitlines()]
    assert said[0] == ["Z", str(z.pid)]
    assert [line[:2] for line in said[1:]] == [[str(ranked.pid), "5"], [str(unranked.pid), "-"], [str(other.pid), "6"]]
    secrets = [int(line[2]) for line in said[1:]]
    assert len(set(secrets)) == 3 and min(secrets) > 2 ** 32  # one of its own for each, drawn from 63 bits
    assert [s["secret"] for s in seen] == [secrets[0], secrets[2]]  # and each process knows its own


_FORKER = textwrap.dedent('''
    import json, os, subprocess, sys
    from course.sandbox import zygote as zygotes
    read, write = os.pipe()
    spare = os.open(os.path.join(sys.argv[1], "zprobe.py"), os.O_RDONLY)  # the caller's: not the zygote's
    z = zygotes.Zygote(preload=("json",), report_fd=write, fork=True)
    os.close(write)
    child = z.popen([sys.executable, "-m", "zprobe"], env=dict(os.environ), cwd=sys.argv[1], stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=120)
    zfds = [os.readlink(f"/proc/{z.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{z.pid}/fd")]  # set up: serving
    mine = {name: os.readlink(f"/proc/self/fd/{fd}") for name, fd in (("spare", spare),)}
    print(json.dumps({
        "zygote_ppid": int(open(f"/proc/{z.pid}/stat").read().rsplit(")", 1)[1].split()[1]), "me": os.getpid(),
        "zygote_comm": open(f"/proc/{z.pid}/comm").read().strip(),
        "zygote_cmdline": open(f"/proc/{z.pid}/cmdline", "rb").read().decode().split("\\0")[:5],
        "zygote_fds": zfds, "mine": mine, "child": json.loads(out), "child_pid": child.pid,
    }))
    z.close()
    print(json.dumps({"zygote_exit": z._proc.returncode, "report": os.read(read, 4096).decode().splitlines()}))
''')


@pytest.mark.parametrize("flags", [["-s", "-P"], []], ids=["the-zygotes-flags", "plain-python"])
def test_a_zygote_forked_from_its_caller_is_one_an_exec_would_give(probe_dir, flags):
    """Zygote(fork=True) (torchrun's agents: one import of torch, not two) forks the caller where that gives the
    zygote an exec would (the caller started with the zygote's flags and has imported the preload): the zygote
    is the caller's child, holds only its channels and the standard streams, names itself, reports, runs modules
    as a fresh interpreter would and ends when closed. A caller without those flags gets an exec'd zygote."""
    out = subprocess.run([sys.executable, *flags, "-c", _FORKER, str(probe_dir)], capture_output=True, text=True,
                         timeout=150, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    seen, ended = (json.loads(line) for line in out.stdout.splitlines())
    forked = bool(flags)
    assert seen["zygote_ppid"] == seen["me"]
    assert seen["zygote_comm"] == "zygote"
    assert ("course.sandbox.zygote" in seen["zygote_cmdline"]) is not forked, seen["zygote_cmdline"]
    assert not set(seen["mine"].values()) & set(seen["zygote_fds"]), seen  # the caller's descriptors stay its own
    child = seen["child"]
    assert child["name"] == "__main__" and child["path0"] == str(probe_dir) and child["comm"] == "zprobe", child
    assert sorted(child["fds"])[:3] == [0, 1, 2] and len(child["fds"]) == 4, child  # + its own listing
    assert ended["zygote_exit"] == 0
    assert ended["report"][0].startswith("Z ") and ended["report"][1].startswith(f"{seen['child_pid']} - "), ended
    assert child["secret"] == int(ended["report"][1].split()[2])  # found in the module as the package knows it


def test_a_process_gets_the_descriptors_passed_under_their_numbers_and_dies_with_the_zygote_when_asked():
    """pass_fds: the caller's descriptors, at the same numbers in the child (torchrun's agents get the report pipe
    so); deathsig: the child gets that signal when the zygote ends, as a zygote does when its caller is gone (an
    agent never outlives its launcher). Without it the child goes on."""
    from course.proc import alive

    read, write = os.pipe()
    spare = os.dup(write)  # a descriptor of ours that is not passed: the child must not hold it
    z = zygotes.Zygote(preload=())
    try:
        lister = ("import os, sys, time\n"
                  "fds = [int(fd) for fd in os.listdir('/proc/self/fd')]\n"
                  "os.write(int(sys.argv[1]), (' '.join(map(str, fds)) + '\\n').encode())\n"
                  "time.sleep(120)\n")
        dying = z.popen([sys.executable, "-c", lister, str(write)], pass_fds=[write], deathsig=signal.SIGKILL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        staying = z.popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(write)
        listing = b""
        while not listing.endswith(b"\n"):
            chunk = os.read(read, 4096)
            assert chunk, "the child never wrote on the descriptor passed to it"
            listing += chunk
        held = sorted(int(fd) for fd in listing.split())
        assert write in held and spare not in held, (held, write, spare)
    finally:
        z.close()  # the zygote ends: what asked for a signal gets it
    end = time.monotonic() + 10
    while alive(dying.pid) and time.monotonic() < end:
        time.sleep(0.05)
    try:
        assert not alive(dying.pid)
        assert alive(staying.pid)
    finally:
        for pid in (dying.pid, staying.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.close(read)
        os.close(spare)
