"""Old names kept for one release: a module ``__getattr__`` that warns and hands them on."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["deprecated_names"]


def deprecated_names(module: str, aliases: dict[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``aliases`` (old name -> ``(new path, value)``):
    each access emits a ``DeprecationWarning`` naming the new path; other names raise
    ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_path, value = aliases[name]
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in the next release; "
            f"use {new_path}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
