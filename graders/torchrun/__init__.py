"""The checks of ``exercises/ex4-torchrun/torchrun.ipynb``, under the names its test cells call: ``graders.torchrun.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_atomic_checkpoint": "checks",
    "check_checkpoint_rank0": "checks",
    "check_ddp_training": "checks",
    "check_destroy": "destroy",
    "check_multinode_ranks": "checks",
    "check_restart_resume": "restart",
    "check_standalone_ranks": "checks",
    "try_restart": "restart",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
