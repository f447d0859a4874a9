"""oneDNN's primitive cache in vLLM's CPU processes: off unless the operator sets it.

On CPU, vLLM runs each linear layer through oneDNN (``vllm._custom_ops.create_onednn_mm``
/ ``onednn_mm``): a matmul primitive per batch size ``M`` (the tokens of one engine
step), which each layer's handler keeps for its last 32 sizes. oneDNN keeps every
primitive it creates in a process-wide cache as well, of 1024 entries by default
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A scoring server's steps come in a new size almost
every time (requests of every length, packed as they arrive), so that cache fills over
hours, each new size adding a primitive per layer to vLLM's worker's heap, held for good
(docs/operations.md, "What vLLM keeps"; the growth is measured on vLLM's own layers in
this module's test). With the process-wide cache
off, a layer's handler still serves its last 32 sizes; a size outside them is a new
primitive (oneDNN's JIT, tens of microseconds per layer).

:func:`bound_primitive_cache` sets it for the vLLM processes the server starts (they
inherit the environment, and oneDNN reads it at its first primitive), leaving a value the
operator set.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["ONEDNN_CACHE_ENV", "PRIMITIVE_CACHE_CAPACITY", "bound_primitive_cache"]

#: oneDNN's environment variable for its process-wide primitive cache (entries).
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"

#: The server's value for it: off (vLLM's per-layer handlers keep their own 32).
PRIMITIVE_CACHE_CAPACITY = 0


def bound_primitive_cache(environ: MutableMapping[str, str] | None = None) -> str:
    """Set :data:`ONEDNN_CACHE_ENV` to :data:`PRIMITIVE_CACHE_CAPACITY` in ``environ``
    (default ``os.environ``) unless it is set; the value in effect."""
    env = os.environ if environ is None else environ
    return env.setdefault(ONEDNN_CACHE_ENV, str(PRIMITIVE_CACHE_CAPACITY))
