"""docker/ci/apt-mirror.sh: the Debian mirror debootstrap uses is this machine's own, read from its apt
sources in either format, and named nowhere in the repository. No Docker engine needed; apt-get is.

The sources here are written to a temporary folder and apt-get is pointed at them with APT_CONFIG
(apt's own variable); their mirrors are local folders (file: URIs), so nothing is looked up or fetched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docker" / "ci" / "apt-mirror.sh"

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("apt-get") is None, reason="no apt-get (not a Debian machine)")]


def mirror(tmp_path: Path, one_line: str = "", deb822: str = "", suite: str = "bookworm"):
    """Run apt-mirror.sh against sources.list ``one_line`` and sources.list.d/test.sources ``deb822``."""
    parts = tmp_path / "sources.list.d"
    parts.mkdir(exist_ok=True)
    (tmp_path / "lists").mkdir(exist_ok=True)
    (tmp_path / "sources.list").write_text(one_line)
    if deb822:
        (parts / "test.sources").write_text(deb822)
    (tmp_path / "apt.conf").write_text(f'Dir::Etc::sourcelist "{tmp_path}/sources.list";\n'
                                       f'Dir::Etc::sourceparts "{parts}";\nDir::State::Lists "{tmp_path}/lists";\n')
    return subprocess.run(["bash", str(SCRIPT), suite], capture_output=True, text=True,
                          env={**os.environ, "APT_CONFIG": str(tmp_path / "apt.conf")})


def test_one_line_sources(tmp_path):
    """sources.list lines: deb-src and a cdrom (debootstrap cannot use one) are passed over; options are fine."""
    r = mirror(tmp_path, "# deb file:/srv/commented bookworm main\n"
                         "deb-src file:/srv/sources-only bookworm main\n"
                         "deb cdrom:[Debian GNU/Linux 12]/ bookworm main\n"
                         "deb [arch=amd64 signed-by=/etc/k.gpg] file:/srv/debian bookworm main contrib\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "file:/srv/debian/"


def test_deb822_sources(tmp_path):
    """*.sources stanzas: a disabled one is passed over, the first URI of the first enabled one is taken."""
    r = mirror(tmp_path, deb822="Types: deb\nURIs: file:/srv/disabled\nSuites: bookworm\nComponents: main\n"
                                "Enabled: no\n\n"
                                "Types: deb deb-src\nURIs: file:/srv/debian file:/srv/second\n"
                                "Suites: bookworm bookworm-updates\nComponents: main\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "file:/srv/debian/"


def test_only_the_suite_asked_for(tmp_path):
    """The security archive (another suite) is not the mirror; with no source for the suite, say what to do."""
    r = mirror(tmp_path, "deb file:/srv/debian-security bookworm-security main\n"
                         "deb file:/srv/debian bookworm main\n")
    assert r.stdout.strip() == "file:/srv/debian/", r.stderr
    r = mirror(tmp_path, "deb file:/srv/debian bookworm main\n", suite="trixie")
    assert r.returncode != 0 and r.stdout == ""
    assert "MIRROR=" in r.stderr
