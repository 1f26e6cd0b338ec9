"""What the probe in each worker recorded of its files: what it saved, opened for writing and moved into place.

The probe lives in the worker's own process, so this is the workers' view, not evidence the worker cannot write:
checks judge from it what the kernel cannot tell (which rank wrote), and fall back on it where the kernel could not
be asked (no inotify: a student's self-check on a Mac)."""

from __future__ import annotations

import os

from course.checks import CheckFailed, expect, torchrun


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


def commits_of(w: torchrun.Worker, run: torchrun.Run) -> list[dict]:
    """The moments the checkpoint file was (re)placed: a rename onto it, or a save straight into it."""
    return [e for e in w.events
            if (e["event"] == "rename" and e.get("dst") == run.ckpt_path)
            or (e["event"] == "save" and e.get("path") == run.ckpt_path)]


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
