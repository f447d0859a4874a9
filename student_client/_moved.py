"""Old import paths of modules that moved (they work for one release, with a warning).

Each old module is a stub whose ``__getattr__`` is :func:`forward`: the first use of a
name warns (``DeprecationWarning`` naming the new module) and returns the new module's
object, so ``from student_client.client import TeacherClient`` keeps working.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["forward"]


def forward(old: str, *new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old`` that finds names in the ``new`` modules (in
    order) and warns that ``old`` moved."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for module in new:
            target = importlib.import_module(module)
            if hasattr(target, name):
                warnings.warn(
                    f"{old} is deprecated and will be removed in the next release: import "
                    f"{name} from {module}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(target, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
