"""This process's launcher settings, changed by one explicit call: :func:`configure`.

A process that runs checks on code it must not trust (the verifier) says so here
once, instead of assigning the launcher modules' globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Settings:
    #: every job reads its ranks' results as with ``launch(safe_results=True)``, whatever the caller asked
    #: (a process that runs checks on code it must not trust: :mod:`course.grading.verifier`)
    safe_results: bool = False
    #: fork the ranks' forkserver from this process, torch already imported, instead of starting it as a fresh
    #: interpreter that imports torch again (about 2.5 CPU-s per graded submission); for a process that has
    #: nothing to hide from its ranks yet and no thread of its own (the verifier, before it reads its request).
    #: See :func:`course.launcher.forkserver.ensure_running`.
    fork_forkserver: bool = False
    #: notebook cell file -> how IPython names it ("Cell In[7]"), for cells of a kernel other than this
    #: process's (the verifier learns them from the kernel's record); this process's own IPython is asked too
    cell_names: dict[str, str] = field(default_factory=dict)


#: the settings every job of this process reads
SETTINGS = Settings()


def configure(*, safe_results: bool | None = None, fork_forkserver: bool | None = None,
              cell_names: dict[str, str] | None = None) -> Settings:
    """Change this process's launcher settings (None leaves one as it is; ``cell_names`` are added to those
    known) and return them."""
    if safe_results is not None:
        SETTINGS.safe_results = bool(safe_results)
    if fork_forkserver is not None:
        SETTINGS.fork_forkserver = bool(fork_forkserver)
    if cell_names:
        SETTINGS.cell_names.update(cell_names)
    return SETTINGS
