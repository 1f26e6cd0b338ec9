"""Waiting for a server a test started (JupyterLab, the hub): until it answers, its process ends, or a deadline."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable

import pytest


def wait_for_http(url: str, what: str, logs: Callable[[], str], process: subprocess.Popen | None = None,
                  deadline_s: float = 90, every_s: float = 0.3, cafile: str | None = None) -> None:
    """Return once GET ``url`` answers 200; fail with ``what`` and ``logs()`` when ``process`` (if given) has ended
    or ``deadline_s`` passed first. ``cafile``: the certificate an HTTPS server's must be signed by (verified)."""
    context = ssl.create_default_context(cafile=cafile) if cafile else None
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            pytest.fail(f"{what} did not come up:\n{logs()}")
        time.sleep(every_s)
