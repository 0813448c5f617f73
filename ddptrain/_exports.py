"""Public names a package imports on first use (PEP 562), so that importing it stays torch-free.

``python -m ddptrain --help``, config errors and the launcher's fork server import ``ddptrain`` and
``ddptrain.launch`` long before (or without ever) needing torch; their public names are therefore
looked up lazily. This module imports nothing but :mod:`importlib`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The module-level ``__getattr__`` and ``__dir__`` for a package whose names live elsewhere.

    ``namespace`` is the package's ``globals()``; ``exports`` maps each public name to the module
    that defines it. A name is imported on first access and then cached in ``namespace``, so the
    lookup runs once per name.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
