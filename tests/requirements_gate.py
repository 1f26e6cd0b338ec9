"""Tests that need a service (Docker, a browser, PostgreSQL) skip without it, except where CI requires it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

#: where CI (.ci/run) builds the Docker images in the background while the tests run: the file the build writes its
#: exit status to once it ends (empty until then), and the build's log
IMAGES_STATUS, IMAGES_LOG = "DDP_COURSE_DOCKER_IMAGES_STATUS", "DDP_COURSE_DOCKER_IMAGES_LOG"
#: the longest a test waits for that build (a cold one takes 3 to 5 minutes on our 2-core machines)
IMAGES_WAIT_S = 1200


def unavailable(reason: str, require_env: str) -> None:
    """Skip with ``reason``, or fail where the environment variable ``require_env`` is "1" (CI sets it)."""
    if os.environ.get(require_env) == "1":
        pytest.fail(f"{reason} ({require_env}=1)", pytrace=False)
    pytest.skip(reason)


def await_docker_images() -> None:
    """Where the Docker images are still being built beside the tests (``DDP_COURSE_DOCKER_IMAGES_STATUS`` names the
    build's status file), wait for the build to end; one that failed, or did not end within ``IMAGES_WAIT_S``, makes
    the test unavailable (a failure where ``DDP_COURSE_REQUIRE_DOCKER=1``) with the end of its log."""
    status = os.environ.get(IMAGES_STATUS)
    if not status:
        return
    deadline = time.monotonic() + IMAGES_WAIT_S
    while not (code := Path(status).read_text().strip() if Path(status).is_file() else ""):
        if time.monotonic() > deadline:
            unavailable(f"the Docker images were still building after {IMAGES_WAIT_S} s ({IMAGES_STATUS}={status})",
                        "DDP_COURSE_REQUIRE_DOCKER")
        time.sleep(2)
    if code != "0":
        log = Path(os.environ.get(IMAGES_LOG) or "/nonexistent")
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"
        unavailable(f"the Docker images did not build (exit {code}; log {log}):\n{tail}", "DDP_COURSE_REQUIRE_DOCKER")
