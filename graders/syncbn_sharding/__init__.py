"""The checks of ``exercises/ex3-syncbn-sharding/syncbn_sharding.ipynb``, under the names its test cells call: ``graders.syncbn_sharding.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_fsdp_memory": "memory",
    "check_shard_load": "checks",
    "check_shard_save": "checks",
    "check_syncbn_accuracy": "checks",
    "check_syncbn_backward": "checks",
    "check_syncbn_output": "checks",
    "check_syncbn_running_stats": "checks",
    "check_zero_memory": "memory",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
