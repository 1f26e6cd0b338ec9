"""The checks of ``exercises/ex1-parallelism/parallelism.ipynb``, under the names its test cells call: ``graders.parallelism.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_average_gradients": "checks",
    "check_shard_sizes": "checks",
    "check_shards": "checks",
    "check_tensor_parallel": "tensor_parallel",
    "check_tensor_parallel_collectives": "tensor_parallel",
    "check_two_stage": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
