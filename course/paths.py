"""Where the course's own files are: the checkout (or installed tree) that holds the ``course`` package."""

from __future__ import annotations

import os
from pathlib import Path

#: the folder that holds the ``course`` package (a checkout: also lessons/, exercises/, .git)
CHECKOUT = Path(__file__).resolve().parent.parent


def course_root() -> Path:
    """The folder holding ``lessons/`` and ``exercises/`` (a checkout, or DDP_COURSE_ROOT)."""
    env = os.environ.get("DDP_COURSE_ROOT")
    if env:
        return Path(env).resolve()
    if (CHECKOUT / "lessons").is_dir():
        return CHECKOUT
    return Path.cwd()
