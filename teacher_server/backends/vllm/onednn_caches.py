"""oneDNN's caches in vLLM's CPU processes, bounded for a scoring server.

On CPU, vLLM runs each linear layer through oneDNN (``vllm._custom_ops.create_onednn_mm``
/ ``onednn_mm``, chosen by ``dispatch_cpu_unquantized_gemm``): a matmul primitive per
batch size ``M`` (the tokens of one engine step), kept twice: by the layer's handler, for
its last 32 sizes (vLLM's argument), and by oneDNN's process-wide cache, 1024 entries by
default (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A scoring server's steps come in a new size
almost every time (requests of every length, packed as they arrive), so both fill as the
sizes come, each new size adding a primitive per layer to vLLM's worker's heap, held for
good: the worker's memory rises round after round long after the traffic stopped changing
(docs/operations.md, "What vLLM keeps"; measured on vLLM's own layers in this module's
test).

The server bounds them in the vLLM processes it starts, never elsewhere: before starting
vLLM, :func:`bound_caches` sets oneDNN's process-wide cache off
(:data:`PRIMITIVE_CACHE_CAPACITY`) and asks for :data:`LAYER_CACHE_SIZES` sizes per layer
(:data:`LAYER_CACHE_ENV`), each unless the operator set it; vLLM's processes inherit the
environment. :func:`register`, a ``vllm.general_plugins`` entry point
(``topk_distill_onednn_layers``: vLLM runs it in each of its processes before the model
loads), passes that size to vLLM's ``create_onednn_mm`` where the variable is set, and
does nothing where it is not (a vLLM the operator runs without this server). A size
outside a layer's last few is a new primitive: oneDNN's JIT, once per layer and step.
Listed with what it relies on in :mod:`teacher_server.backends.vllm.hooks`
(``ONEDNN_LAYER_CACHE``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import MutableMapping
from typing import Any

__all__ = [
    "LAYER_CACHE_ENV",
    "LAYER_CACHE_SIZES",
    "ONEDNN_CACHE_ENV",
    "PRIMITIVE_CACHE_CAPACITY",
    "bound_caches",
    "register",
]

#: oneDNN's environment variable for its process-wide primitive cache (entries).
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"

#: The server's value for it: off (the layers keep their own).
PRIMITIVE_CACHE_CAPACITY = 0

#: The variable :func:`register` reads: batch sizes each oneDNN layer keeps.
LAYER_CACHE_ENV = "TOPK_DISTILL_ONEDNN_LAYER_CACHE"

#: The server's value for it (vLLM's own: 32).
LAYER_CACHE_SIZES = 8


def bound_caches(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`ONEDNN_CACHE_ENV` and :data:`LAYER_CACHE_ENV` in ``environ`` (default
    ``os.environ``) to the server's values unless set; the values in effect."""
    env = os.environ if environ is None else environ
    return {
        ONEDNN_CACHE_ENV: env.setdefault(ONEDNN_CACHE_ENV, str(PRIMITIVE_CACHE_CAPACITY)),
        LAYER_CACHE_ENV: env.setdefault(LAYER_CACHE_ENV, str(LAYER_CACHE_SIZES)),
    }


def register() -> None:
    """Where :data:`LAYER_CACHE_ENV` is set: vLLM's ``create_onednn_mm`` keeps at most
    that many sizes per layer (idempotent). Nothing under a vLLM release the hook was
    not checked for (``hooks.ONEDNN_LAYER_CACHE``, one warning), nor where this vLLM
    build has no oneDNN layers."""
    raw = os.environ.get(LAYER_CACHE_ENV)
    if not raw:
        return
    import vllm._custom_ops as ops

    from teacher_server.backends.vllm.hooks import (
        ONEDNN_LAYER_CACHE,
        report,
        version_problem,
    )

    current = getattr(ops, "create_onednn_mm", None)
    if current is None or getattr(current, "topk_distill", False):
        return
    problem = version_problem(ONEDNN_LAYER_CACHE)
    report(ONEDNN_LAYER_CACHE, problem)
    if problem is None:
        ops.create_onednn_mm = _capped(current, int(raw))


def _capped(create: Any, sizes: int) -> Any:
    """``create_onednn_mm`` with its ``primitive_cache_size`` at most ``sizes``."""

    @functools.wraps(create)
    def create_onednn_mm(weight: Any, primitive_cache_size: int = 128) -> Any:
        return create(weight, min(primitive_cache_size, sizes))

    create_onednn_mm.topk_distill = True  # type: ignore[attr-defined]
    return create_onednn_mm
