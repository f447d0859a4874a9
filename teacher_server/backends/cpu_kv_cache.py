"""KV-cache size for vLLM on CPU when the operator gave none.

Left alone, vLLM on CPU reserves ``--gpu-memory-utilization`` (0.9) of the machine's RAM
for its KV cache and refuses to start when that much is not free: a plain
``teacher-server serve --model PATH`` would fail on most CPU machines. Scoring needs
little cache (one sequence's blocks per request in flight), so the default here is a
quarter of the memory available now, between 1 and 8 GiB. vLLM's own
``--kv-cache-memory-bytes`` or the ``VLLM_CPU_KVCACHE_SPACE`` variable (GiB) override it.
"""

from __future__ import annotations

import os

__all__ = ["CPU_KV_CACHE_ENV", "cpu_kv_cache_bytes", "default_cpu_kv_cache_bytes"]

#: vLLM's environment variable for the CPU KV cache size, in GiB.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"

_GIB = 1024**3
_MIN_BYTES = 1 * _GIB
_MAX_BYTES = 8 * _GIB


def default_cpu_kv_cache_bytes(available_bytes: int) -> int:
    """A quarter of ``available_bytes``, clamped to [1 GiB, 8 GiB], in whole GiB."""
    quarter = available_bytes // 4 // _GIB * _GIB
    return int(min(max(quarter, _MIN_BYTES), _MAX_BYTES))


def cpu_kv_cache_bytes(requested: int | None) -> int | None:
    """The ``kv_cache_memory_bytes`` engine argument to use on CPU: ``requested`` when
    given, ``None`` when ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM reads it), else the
    default for the memory available now."""
    if requested is not None:
        return requested
    if os.environ.get(CPU_KV_CACHE_ENV, "") != "":
        return None
    import psutil  # a vLLM dependency, like this module's only caller

    return default_cpu_kv_cache_bytes(int(psutil.virtual_memory().available))
