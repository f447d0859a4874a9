"""The backends by name: the one table the CLI and :func:`load_backend` read.

Each entry is imported only when chosen (``vllm`` is heavy and absent on the student
side); ``base.py`` defines the interface and imports no backend, so there is no cycle.
A backend declares its own flags (``Backend.Flags``, ``Backend.cli_parents``) and builds
itself from them (``Backend.from_cli_args``), so the CLI names no backend.
"""

from __future__ import annotations

import importlib
from typing import Any

from teacher_server.backends.base import Backend

__all__ = ["BACKENDS", "backend_class", "load_backend"]

#: name -> "module:class" of the backend.
BACKENDS: dict[str, str] = {
    "vllm": "teacher_server.backends.vllm.backend:VLLMBackend",
    "transformers": "teacher_server.backends.transformers_backend:TransformersBackend",
    "replay": "teacher_server.backends.replay_backend:ReplayBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (its module imported now)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    found: type[Backend] = getattr(importlib.import_module(module), cls)
    return found


def load_backend(name: str, **kwargs: Any) -> Backend:
    """Construct the backend registered as ``name`` with ``kwargs``."""
    return backend_class(name)(**kwargs)
