"""Session fixtures: every attack graded once per path (see runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import report_sections  # noqa: E402
import runs  # noqa: E402

_done: dict = {}


@pytest.fixture(scope="session")
def grade_batch(tmp_path_factory):
    _done["grade"] = runs.grade_batch(tmp_path_factory)
    return _done["grade"]


@pytest.fixture(scope="session")
def autograde_batch(tmp_path_factory):
    _done["autograde"] = runs.autograde_batch(tmp_path_factory)
    return _done["autograde"]


@pytest.fixture
def host_listener():
    """Listeners on this host's own addresses (:class:`runs.Listener`) that sandboxed code must not reach."""
    listener = runs.Listener()
    yield listener
    listener.close()


def _table() -> None:
    """Each attack's score and time on each path: the figures the suite's report quotes."""
    if not _done:
        return
    import attacks

    lines = []
    paths = sorted(_done)
    lines.append(f"{'attack':18}" + "".join(f"{p:>24}" for p in paths) + "   bound")
    for attack in attacks.ATTACKS:
        cells = []
        for path in paths:
            batch = _done[path]
            outcome = batch.outcomes.get(attack.name)
            if outcome is None:  # not played on this path (see the table above attacks.ATTACKS)
                cells.append("-")
                continue
            top = sum(float(c.metadata["nbgrader"].get("points", 0)) for c in attacks.test_cells(batch.source))
            cells.append(f"{outcome.elapsed:7.0f} s {sum(outcome.scores.values()):5g} / {top:g}")
        lines.append(f"{attack.name:18}" + "".join(f"{c:>24}" for c in cells) + f"   {attack.bound():.0f}")
    for path in paths:
        lines.append(f"{path}: all {len(_done[path].outcomes)} submissions in {_done[path].elapsed:.0f} s")
    for path in paths:  # this host's own addresses only
        targets = ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in _done[path].network_targets)
        lines.append(f"{path}: the network attack aimed at {targets}")
    report_sections.add("adversarial submissions (seconds; score / max)", lines)


report_sections.at_session_end(_table)
