"""Engines that score token sequences: ``vllm`` (fast path), ``transformers`` (reference
and fallback), ``replay`` (a recording). All implement :class:`~.base.Backend`."""

from teacher_server.backends import base
from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.backends.registry import BACKENDS, load_backend
from topk_protocol._deprecation import deprecated_names

__all__ = ["BACKENDS", "Backend", "BackendInfo", "load_backend"]

__getattr__ = deprecated_names(__name__, base.DEPRECATED)
