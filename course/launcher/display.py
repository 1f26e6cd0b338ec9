"""How the engine's own errors show in a notebook: the student's cells and the message, no engine frames.

A job that fails raises :class:`~course.errors.LaunchError` from deep in the launcher, and a failed check raises
:class:`~course.errors.CheckFailed` from the check package; IPython would print every frame in between (the
launcher's, the checks') before the message, which already says which rank did what and where. In an IPython
kernel, :func:`install` makes those two kinds print as the student's frames (``Cell In[3], line 1``) and the
message once. Every other exception, and plain Python outside IPython, is left as it is.
"""

from __future__ import annotations

import os
import sys
import types

from course.errors import CheckFailed, CourseError

_ENGINE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the course package
_CHECK_PACKAGES = ("graders",)


def _engine_dirs() -> tuple[str, ...]:
    dirs = [_ENGINE]
    for name in _CHECK_PACKAGES:
        module = sys.modules.get(name)
        dirs += [os.path.abspath(p) for p in getattr(module, "__path__", None) or []]
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def student_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The same traceback without the frames of the engine and the check packages."""
    engine = _engine_dirs()
    kept = []
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(engine):
            kept.append(tb)
        tb = tb.tb_next
    chain = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def _show(shell, etype, value, tb, tb_offset=None):
    shell.showtraceback((etype, value, student_frames(tb) or tb), tb_offset=tb_offset)


def install() -> bool:
    """In an IPython kernel, show the engine's errors without its frames; True when installed."""
    if "IPython" not in sys.modules:
        return False
    try:
        shell = sys.modules["IPython"].get_ipython()
    except Exception:  # noqa: BLE001 - a broken IPython: leave the default display
        return False
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    if getattr(shell, "custom_exceptions", ()) not in ((), (CourseError, CheckFailed)):
        return False  # someone else's handler: do not replace it
    shell.set_custom_exc((CourseError, CheckFailed), _show)
    return True
