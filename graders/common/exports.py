"""The public names of a notebook's grader package, each imported from its module when first asked for.

A package's ``__init__`` lists them (``EXPORTS = {name: module}``, a literal the engine's and the tests' readers
parse) and takes its ``__getattr__`` and ``__dir__`` from :func:`lazy`, so a rank that unpickles one harness
imports that module alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package``: a name of ``exports`` is looked up in its module, once."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
