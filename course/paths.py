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


#: what an nbgrader course directory holds at its top (``source/`` beside it is where releases come from)
_NBGRADER_CONFIG = "nbgrader_config.py"


def is_course_source(folder: Path) -> bool:
    """Whether ``folder`` is where students' copies come from: inside the course's ``exercises/`` or an nbgrader
    course's ``source/``. Files written there could be copied to students (``init``, ``release``, ``lab``)."""
    folder = Path(folder).resolve()
    exercises = course_root() / "exercises"
    if folder == exercises or exercises in folder.parents:
        return True
    return any(p.name == "source" and (p.parent / _NBGRADER_CONFIG).is_file() for p in (folder, *folder.parents))


def leave_the_sources() -> Path | None:
    """Run in the course's own sources, move this process to a scratch folder; elsewhere do nothing.

    A source notebook run where it lies (an instructor trying the reference) writes its scripts, reference
    solutions included, into its working folder; moved out first, it never leaves them among the files that
    reach students. The scratch folder (with copies of the folder's other files: given scripts, data) is
    removed when the process ends. Returns it, or None where nothing moved (a student's copy).
    """
    import atexit
    import shutil
    import tempfile

    here = Path.cwd()
    if not is_course_source(here):
        return None
    scratch = Path(tempfile.mkdtemp(prefix=f"ddp-course-{here.name}-"))
    for path in here.iterdir():
        if path.is_file() and path.suffix != ".ipynb":
            shutil.copy2(path, scratch / path.name)
    atexit.register(shutil.rmtree, scratch, True)
    os.chdir(scratch)
    print(f"(the course's source notebook, run in place: the files it writes go to {scratch}, not beside the sources)")
    return scratch
