"""Tests that need a service (Docker, a browser, PostgreSQL) skip without it, except where CI requires it."""

from __future__ import annotations

import os

import pytest


def unavailable(reason: str, require_env: str) -> None:
    """Skip with ``reason``, or fail where the environment variable ``require_env`` is "1" (CI sets it)."""
    if os.environ.get(require_env) == "1":
        pytest.fail(f"{reason} ({require_env}=1)", pytrace=False)
    pytest.skip(reason)
