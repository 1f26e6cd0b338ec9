"""The checks of ``exercises/ex3-syncbn-sharding/fsdp_checkpoint.ipynb``, under the names its test cells call: ``graders.fsdp_checkpoint.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "Net": "checks",
    "check_checkpoint": "checkpoint",
    "check_clipping": "precision",
    "check_export_parts": "export",
    "check_mixed_precision": "precision",
    "check_shard": "checks",
    "check_training": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
