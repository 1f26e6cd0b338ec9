"""The launcher's watch on a job's folders (course/launcher/fswatch.py): the kernel's account of what was done to each
file, which the job's workers cannot forge."""

from __future__ import annotations

import os

import pytest

from course.launcher.fswatch import FileEvent, FolderWatch

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="inotify is Linux's")


def _kinds(events, name):
    return [e.kind for e in events if e.name == name]


def test_an_atomic_replace_and_a_write_in_place_look_different(tmp_path):
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    watch = FolderWatch([str(folder)])
    (folder / "ckpt.pt.tmp").write_bytes(b"new")
    os.replace(folder / "ckpt.pt.tmp", folder / "ckpt.pt")  # atomic
    (folder / "between").write_bytes(b"")  # the kernel would merge two unread moves onto one name (cookie aside)
    (elsewhere / "far.tmp").write_bytes(b"far")
    os.replace(elsewhere / "far.tmp", folder / "ckpt.pt")  # moved in from another folder
    (folder / "final.pt").write_bytes(b"in place")
    (folder / "final.pt").unlink()
    events = watch.stop()
    assert events is not None, watch.problem
    assert _kinds(events, "ckpt.pt.tmp") == ["create", "modify", "close_write", "moved_from"]
    assert _kinds(events, "ckpt.pt") == ["moved_to", "moved_to"]
    first, second = [e for e in events if e.name == "ckpt.pt"]
    assert first.cookie and first.cookie in {e.cookie for e in events if e.kind == "moved_from"}
    assert second.cookie not in {e.cookie for e in events if e.kind == "moved_from"}  # its source was not watched
    assert _kinds(events, "final.pt") == ["create", "modify", "close_write", "delete"]
    assert all(isinstance(e, FileEvent) and e.folder == str(folder) for e in events)


def test_a_folder_that_cannot_be_watched_says_why(tmp_path):
    watch = FolderWatch([str(tmp_path / "missing")])
    assert watch.stop() is None and "cannot watch" in watch.problem


def test_the_processes_that_write_are_named_by_the_kernel_not_by_themselves(tmp_path):
    """Given the processes that may write, the watch names those that held a file of the folder open for writing
    (with the RANK they were started with), not one that only read it, whatever the processes say about themselves."""
    import subprocess
    import sys
    import time

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "old.pt").write_bytes(b"old")
    procs: list = []
    watch = FolderWatch([str(folder)], holders=lambda: [p.pid for p in procs])
    code = ("import sys, time\ntime.sleep(0.4)\nwith open(sys.argv[1], sys.argv[2]) as fh:\n"
            "    fh.read() if sys.argv[2] == 'rb' else fh.write(b'x' * 1000)\n    time.sleep(0.3)\n")
    for rank, (name, mode) in enumerate([("new.pt.tmp", "wb"), ("old.pt", "rb"), ("final.pt", "wb")]):
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(folder / name), mode],
                                      env={**os.environ, "RANK": str(rank)}))
    for p in procs:
        p.wait(timeout=30)
    time.sleep(0.2)
    assert watch.stop() is not None, watch.problem
    seen = {w["rank"]: sorted(n for _, n in w["names"]) for w in watch.writers.values()}
    assert seen == {0: ["new.pt.tmp"], 2: ["final.pt"]}, seen
    assert not watch.hidden


def _slow_first_look(monkeypatch, seconds: float):
    """Make the watch's first look at the writers take ``seconds`` (what a loaded machine does to it); the event
    that is set once that look has begun."""
    import threading
    import time

    from course.launcher import fswatch

    looked, first = threading.Event(), [True]

    def slow_look(self):
        if first[0]:
            first[0] = False
            looked.set()
            time.sleep(seconds)

    monkeypatch.setattr(fswatch.FolderWatch, "_look", slow_look)
    return looked


def test_a_watch_busy_looking_when_stopped_still_counts_every_move(tmp_path, monkeypatch):
    """stop() waits for the reading thread to drain the kernel's queue, however long its look at the writers
    takes on a loaded machine (it once closed the queue after 5 s under the thread, and the job's last move into
    place went uncounted: 3 checkpoints counted of 4)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    looked = _slow_first_look(monkeypatch, 6)  # past the old 5 s wait
    watch = FolderWatch([str(folder)], holders=lambda: [])
    for n in range(4):
        (folder / "ckpt.tmp").write_bytes(b"x")
        os.replace(folder / "ckpt.tmp", folder / "ckpt.pt")
        if n == 0:
            assert looked.wait(10)  # the thread read the first move and is looking now; the others queue up
    events = watch.stop()
    assert events is not None, watch.problem
    assert _kinds(events, "ckpt.pt") == ["moved_to"] * 4


def test_moves_in_from_an_unwatched_folder_can_merge_and_are_named_lone(tmp_path, monkeypatch):
    """The kernel keeps two moves from an unwatched folder onto one name as one event while the first is unread
    (why a count of them can be short: seen in check_checkpoint_rank0 on a script whose temporary file was in
    /tmp); lone_moves names such moves, and only them."""
    from course.launcher import fswatch

    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    looked = _slow_first_look(monkeypatch, 1)  # the moves below queue up unread meanwhile
    watch = FolderWatch([str(folder)], holders=lambda: [])
    (folder / "start").write_bytes(b"")
    assert looked.wait(10)
    for _ in range(4):
        (elsewhere / "far.tmp").write_bytes(b"far")
        os.replace(elsewhere / "far.tmp", folder / "ckpt.pt")
    for _ in range(4):
        (folder / "near.tmp").write_bytes(b"near")
        os.replace(folder / "near.tmp", folder / "near.pt")
    events = watch.stop()
    assert events is not None, watch.problem
    assert _kinds(events, "ckpt.pt") == ["moved_to"]  # four moves, one event: the kernel merged them
    assert _kinds(events, "near.pt") == ["moved_to"] * 4  # each with its moved_from in between: exact
    assert fswatch.lone_moves(events, str(folder), "ckpt.pt") == [e for e in events if e.name == "ckpt.pt"]
    assert fswatch.lone_moves(events, str(folder), "near.pt") == []
