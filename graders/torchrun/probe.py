"""What the probe in each worker recorded of its files (what it saved, opened for writing and moved into place), and
what the kernel showed the launcher of who wrote.

The probe lives in the worker's own process, so its record is the workers' view, not evidence the worker cannot
write: a worker can rewrite it. Checks use it to name what a worker did, to see writes outside the watched folders,
and where the kernel could not be asked (no inotify: a student's self-check on a Mac); what they rest on is the
kernel's account, read by the launcher in its own process (:func:`writers_from_the_kernel`)."""

from __future__ import annotations

import os

from course.checks import CheckFailed, expect, torchrun
from course.errors import rank_list
from graders.common.torchrun_model import EPOCHS

#: the temporary file the grader's own shift of the checkpoint (at the crash) moves into place
GRADER_TMP = ".ddp-course-grader-shift.tmp"


def writes_of(w: torchrun.Worker, run: torchrun.Run) -> list[str]:
    """What a worker wrote that only rank 0 may write: every file it saved, created or moved into place, wherever
    and under whatever name, apart from its own report-<pid>.json in OUT."""
    report = os.path.join(run.out_dir, "report-")

    def shown(path: str) -> str:
        return os.path.basename(path) if os.path.dirname(path) in (run.out_dir, os.path.dirname(run.ckpt_path)) else path

    found = []
    for e in w.events:
        path = e.get("path") or ""
        if e["event"] == "save" and path:
            found.append(f"torch.save(..., {shown(path)!r})")
        elif e["event"] == "rename" and e.get("dst"):
            found.append(f"os.replace({shown(e.get('src') or '?')!r}, {shown(e['dst'])!r})")
        elif (e["event"] == "open" and e.get("write") and path
              and not (path.startswith(report) and path.endswith(".json"))):
            found.append(f"open({shown(path)!r}) for writing")
    return found


def commits_of(w: torchrun.Worker, run: torchrun.Run, path: str | None = None) -> list[dict]:
    """The moments the checkpoint file (or ``path``) was (re)placed: a rename onto it, or a save straight into it."""
    path = run.ckpt_path if path is None else path
    return [e for e in w.events
            if (e["event"] == "rename" and e.get("dst") == path) or (e["event"] == "save" and e.get("path") == path)]


def atomic_from_the_probe(check: str, run: torchrun.Run, name: str, hint: str) -> None:
    """check_atomic_checkpoint where the kernel could not be asked: judged on the probe's record of rank 0."""
    writers = [w for w in run.workers if w.rank == 0] or run.workers
    direct = [e for w in writers for e in w.events
              if (e["event"] == "save" and e.get("path") == run.ckpt_path)
              or (e["event"] == "open" and e.get("write") and e.get("path") == run.ckpt_path)]
    expect(not direct, check, f"rank 0 wrote the checkpoint in place (straight into {name!r}): a crash or kill "
           "during that write leaves a truncated checkpoint, and the restart cannot load it", ranks=[0], hint=hint)
    renames = [e for w in writers for e in w.events if e["event"] == "rename" and e.get("dst") == run.ckpt_path]
    if not renames:
        if not run.ok:
            raise torchrun.failure(check, run, "no checkpoint was written: ")
        raise CheckFailed(check, f"rank 0 never moved a finished file into {name!r} with os.replace",
                          ranks=[0], hint=hint)
    far = [e for e in renames if os.path.dirname(e.get("src") or "") != os.path.dirname(run.ckpt_path)]
    expect(not far, check, f"the temporary file {far[0]['src'] if far else ''} is not in the checkpoint's folder: "
           "os.replace is atomic only within one file system (across file systems it fails or copies)",
           ranks=[0], hint="put the temporary file next to the checkpoint: tmp = ckpt_path + '.tmp'")


def writers_from_the_kernel(check: str, run: torchrun.Run, context: str = "") -> None:
    """Fail ``check`` when a worker of a rank other than 0 held a file of the checkpoint's folder, or OUT/final.pt
    (any file of OUT but the reports), open for writing, as the launcher saw it in ``/proc/<pid>/fd`` at the
    kernel's inotify events (its RANK from the environment torchrun started it with: a writer is seen when it still
    holds the file as the launcher looks, so a quick write can go unseen); when the kernel saw the checkpoint or
    final.pt put in place more often than one writer does (:func:`_commits_beyond_one_writer`: every move into
    place counts exactly, a save in place at least once); or when a worker hid its open files from the launcher."""
    if run.files is None:
        return  # no inotify here: the probe's record is all there is
    folders = {os.path.realpath(os.path.dirname(run.ckpt_path)): "checkpoint", os.path.realpath(run.out_dir): "out"}
    found: dict = {}
    for w in run.file_writers.values():
        names = sorted(name for folder, name in w["names"] if folders.get(folder) == "checkpoint"
                       or (folders.get(folder) == "out" and not (name.startswith("report-") and name.endswith(".json"))))
        if names and w["rank"] != 0:
            found.setdefault(-1 if w["rank"] is None else w["rank"], set()).update(names)
    if found:
        ranks = sorted(found)
        who = rank_list([r for r in ranks if r >= 0]) if any(r >= 0 for r in ranks) else "a process that is no worker"
        only_final = all(n == "final.pt" for names in found.values() for n in names)
        raise CheckFailed(
            check, context + f"{who} wrote {'the final weights' if only_final else 'the checkpoint'} too (the grader "
            f"saw rank {ranks[0]} hold {', '.join(repr(n) for n in sorted(found[ranks[0]])[:3])} open for writing)",
            ranks=[r for r in ranks if r >= 0], expected="only rank 0 writes the checkpoint and final.pt: every rank "
            "holds the same weights, and several writers race on the same file (a reader can get a half-written one)",
            got="; ".join(f"{'a process without RANK' if r < 0 else f'rank {r}'} held {sorted(found[r])[:3]} open for "
                          "writing" for r in ranks) + " (the kernel's account, read by the grader's launcher)",
            hint="guard every save with `if rank == 0:` (keep collectives such as barrier() outside the guard)")
    _commits_beyond_one_writer(check, run, context)
    if run.files_hidden:
        raise CheckFailed(check, context + f"{len(run.files_hidden)} worker process(es) hid their open files from the "
                          "grader (made themselves undumpable), so who wrote the checkpoint cannot be seen",
                          expected="workers whose open files the kernel shows", got=f"pids {sorted(run.files_hidden)}",
                          hint="leave the process's settings alone: save on rank 0 only")


def kernel_commits(run: torchrun.Run, path: str) -> list:
    """The times the kernel saw ``path`` put in place (a move into the name: exact; a close after writing in place:
    at least one per run of writes), as the launcher watched its folder, less the grader's own move of the
    checkpoint at the crash (its shift, ``run.crash_note`` set). Only where there is inotify (``run.files``)."""
    folder, name = os.path.dirname(path), os.path.basename(path)
    seen = [e for e in run.files if e.folder == folder and e.name == name and e.kind in ("moved_to", "close_write")]
    if path == run.ckpt_path and run.crash_note is not None:
        grader = {e.cookie for e in run.files if e.kind == "moved_from" and e.name == GRADER_TMP}
        mine = next((e for e in seen if e.kind == "moved_to" and e.cookie in grader), None)
        seen = [e for e in seen if e is not mine]
    return seen


def _commits_beyond_one_writer(check: str, run: torchrun.Run, context: str) -> None:
    """The kernel's count of the times the checkpoint and final.pt were put in place (:func:`kernel_commits`)
    against what one writer makes: the checkpoint once after every epoch (:data:`EPOCHS`, one more where the grader
    crashed the job: the restarted attempt may redo the epoch it died in), final.pt once. More: another process
    wrote it too (or rank 0 more often than the specification says), whatever any worker's record says: the
    records are not consulted (a worker can append to them), only to name the other ranks."""
    others = sorted({w.rank for w in run.workers if w.rank > 0})
    owed = {run.ckpt_path: EPOCHS + (1 if run.crash else 0), os.path.join(run.out_dir, "final.pt"): 1}
    for path, most in owed.items():
        name = os.path.basename(path)
        seen = kernel_commits(run, path)
        if len(seen) > most:
            what = "the checkpoint" if path == run.ckpt_path else "the final weights"
            once = f"once after each of the {EPOCHS} epochs" if path == run.ckpt_path else "once, at the end"
            mine = sum(len(commits_of(w, run, path)) for w in run.workers if w.rank == 0)
            if mine >= len(seen):  # rank 0's record accounts for every move: rank 0 wrote it too often (the verdict
                # is the kernel's count either way; a record only names who)
                raise CheckFailed(
                    check, context + f"rank 0 put {what} ({name!r}) in place {len(seen)} times, where it belongs "
                    f"{once} (at most {most})", ranks=[0], expected=f"{name!r} written {once}",
                    got=f"the kernel saw {len(seen)} moves into place or writes of {name!r}; rank 0's record lists "
                    f"{mine}", hint="save the checkpoint at the end of each epoch only (not again after the loop), "
                    "and final.pt once, at the end")
            raise CheckFailed(
                check, context + f"another process wrote {what} too: {name!r} {'was' if path == run.ckpt_path else 'were'} "
                f"put in place {len(seen)} times, where rank 0 alone puts it there {once} (at most {most}; the other "
                f"ranks: {rank_list(others) if others else 'none'})", ranks=others,
                expected=f"every write of {name!r} is rank 0's, {once}", got=f"the kernel saw {len(seen)} moves into "
                f"place or writes of {name!r} (the grader's launcher watched its folder)",
                hint="guard every save with `if rank == 0:` (keep collectives such as barrier() outside the guard), "
                "and save the checkpoint once per epoch")
