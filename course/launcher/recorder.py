"""torch's flight recorder, read one way everywhere: the collectives this process issued, as its process groups saw them.

torch keeps one recorder per backend: gloo's (``torch._C._distributed_c10d._dump_fr_trace``) and nccl's
(``_dump_nccl_trace``, in CUDA builds only). A job on nccl leaves gloo's empty, and a job with groups of both
backends has entries in each, so :func:`bind` reads both and merges them in the order they were created. It takes
torch's dump functions and ``pickle.loads`` when it is called: a module that binds at import, before any student
object is unpickled in the process, reads what the process groups wrote, whatever the student's code later patches.
The launcher turns the recorder on in every rank (``TORCH_FR_BUFFER_SIZE``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

#: torch's dump functions, one per backend's recorder: (name in torch._C._distributed_c10d, backend)
DUMPS = (("_dump_fr_trace", "gloo"), ("_dump_nccl_trace", "nccl"))


def bind(stacks: bool = True) -> Callable[[], list[dict]] | None:
    """A reader of this process's raw flight-recorder entries (torch's dicts, oldest first, every backend's), with
    everything it calls taken now; None in a torch without a flight recorder. ``stacks=False``: without the stack
    traces (cheaper, for a reader polled often). A backend's recorder whose dump raises counts as empty while
    another answers; when none answers, the first error is raised."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    dumps = [(getattr(c10d, name), backend) for name, backend in DUMPS if hasattr(c10d, name)]
    if not dumps:
        return None
    loads, sort = pickle.loads, sorted

    def entries() -> list[dict]:
        merged, errors = [], []
        for dump, backend in dumps:
            try:
                raw = loads(dump(True, stacks, False)).get("entries", [])
            except Exception as err:  # noqa: BLE001 - a backend without a recorder this run (no nccl group, no CUDA)
                errors.append(err)
                continue
            if len(dumps) > 1:
                for entry in raw:
                    entry.setdefault("backend", backend)
            merged.extend(raw)
        if len(errors) == len(dumps):
            raise errors[0]
        if len(dumps) > 1:
            merged = sort(merged, key=lambda e: e.get("time_created_ns") or 0)
        return merged

    return entries


def entry_of(raw: dict) -> dict:
    """One flight-recorder entry in the shape every reader here uses: op, seq, group (the group's description,
    "default_pg"; subgroups may share one), pg (the group's name, the same on every rank), sizes, dtypes, p2p,
    p2p_seq, and backend ("gloo", "nccl": the recorder's, else the prefix of torch's profiling name) and state.

    ``state`` is torch's: "scheduled" (queued), "started", "completed". Only nccl's recorder moves it on (its
    watchdog sees the GPU finish the collective); gloo's entries stay "scheduled" whatever happened. Under nccl a
    collective returns once queued, so "completed" is the only sign that it ran (:mod:`course.launcher.stall`)."""
    group = raw.get("process_group") or ("", "")
    name = str(raw.get("profiling_name", ""))
    backend = raw.get("backend") or (name.split(":", 1)[0] if ":" in name else "")
    return {"op": name.split(":")[-1], "seq": raw.get("collective_seq_id"),
            "group": str(group[1] if len(group) > 1 else group), "sizes": raw.get("input_sizes"),
            "dtypes": [str(d) for d in raw.get("input_dtypes") or []], "p2p": bool(raw.get("is_p2p")),
            "p2p_seq": raw.get("p2p_seq_id"), "backend": str(backend), "state": str(raw.get("state") or ""),
            "pg": str(group[0] if len(group) > 1 else "")}
