"""A package's public names, imported when first used (PEP 562), so that importing the package does no work.

``import runtime`` or ``import planner`` then loads neither torch nor numba
nor Optuna; ``from runtime import apply_plan`` loads what ``apply_plan``
needs, and only that.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A ``__getattr__`` and ``__dir__`` for ``package`` that import each public name from its module on first use.

    Args:
        package: the package's ``__name__`` (named in errors).
        exports: public name -> the module that defines it.

    Raises (the returned ``__getattr__``):
        AttributeError: ``package`` exports no such name.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
