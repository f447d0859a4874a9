"""Engines that score token sequences: ``vllm`` (fast path), ``transformers`` (reference
and fallback), ``replay`` (a recording). All implement :class:`~.base.Backend`."""

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.backends.registry import BACKENDS, load_backend

__all__ = ["BACKENDS", "Backend", "BackendInfo", "load_backend"]
