"""Servers a test started (JupyterLab, the hub): waiting until one answers, logging in to a hub as a browser does."""

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


def hub_login(url: str, user: str, password: str, cert: str | None = None, next_url: str = "/hub/home"):
    """A requests session logged in to the JupyterHub at ``url`` as ``user`` (its login form, posted as a browser
    posts it); ``cert``: the hub's own HTTPS certificate, verified."""
    import requests

    session = requests.Session()
    if cert is not None:
        session.trust_env = False  # REQUESTS_CA_BUNDLE would replace the certificate: this is a local server
        session.verify = cert
    session.get(f"{url}/hub/login", timeout=30)
    response = session.post(f"{url}/hub/login?next={next_url}", timeout=90,
                            data={"username": user, "password": password, "_xsrf": session.cookies.get("_xsrf")})
    assert response.status_code == 200, response.text[:2000]
    return session
