"""Run a function on a module once it is imported, without importing it first.

The verl plugin changes one method of verl's v1 trainer (``verl.trainer.ppo.v1.trainer_base``),
a module that takes seconds to import and needs packages a process that only imports
``verl`` may not have; verl loads the plugin in every process that imports ``verl``.
:func:`when_imported` patches the module at once if it is already imported, else when its
import finishes, through a finder on ``sys.meta_path`` (Python's import hook) that wraps
the module's loader and removes itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]


class _Patching(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and hands out its spec with :class:`_Patching`."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader, self._patch)
        return spec


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` on the module ``name``: now if it is imported, else right
    after its first import (once)."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _Finder(name, patch))
