"""A vLLM general plugin: lets the server trim the memory of vLLM's engine-core process.

vLLM's engine core (the process that schedules; on CPU its one worker is a child of it)
allocates through glibc's ``malloc`` as every process does, and glibc keeps what it frees
(:mod:`teacher_server.malloc_trim`). The worker runs the server's code through the worker
extension; the engine core runs none, but it calls every function registered in the
entry-point group ``vllm.general_plugins`` when it starts (``vllm.plugins``, the hook vLLM
offers plugins), and it answers utility calls by method name between engine steps
(``EngineCoreClient.call_utility_async``). :func:`register`, this package's
``vllm.general_plugins`` entry (``topk_distill_engine_core``), adds one such method to
vLLM's ``EngineCore``: ``malloc_trim(0)`` in the process, returning the resident bytes
given back. It adds nothing else, and nothing runs until the server calls it. It is
listed with vLLM's internals it relies on in :mod:`teacher_server.backends.vllm.hooks`.

``VLLM_PLUGINS`` (vLLM's allow-list of plugin names) can leave it out; the server then
trims the worker only and logs once why (``VLLMBackend.trim_memory``).
"""

from __future__ import annotations

__all__ = ["ENGINE_CORE_TRIM_METHOD", "register"]

#: The ``EngineCore`` method :func:`register` adds (a utility call's method name).
ENGINE_CORE_TRIM_METHOD = "topk_distill_malloc_trim"


def _malloc_trim(self: object) -> int:
    """``malloc_trim(0)`` in the engine-core process; the resident bytes given back."""
    from teacher_server.malloc_trim import malloc_trim

    return malloc_trim()


def register() -> None:
    """Add :data:`ENGINE_CORE_TRIM_METHOD` to vLLM's ``EngineCore`` (idempotent: vLLM
    may load plugins more than once per process); nothing under a vLLM release the
    utility-call path was not checked for (``hooks.ENGINE_CORE_TRIM``, one warning)."""
    from vllm.v1.engine.core import EngineCore

    from teacher_server.backends.vllm.hooks import ENGINE_CORE_TRIM, report, version_problem

    if hasattr(EngineCore, ENGINE_CORE_TRIM_METHOD):
        return
    problem = version_problem(ENGINE_CORE_TRIM)
    report(ENGINE_CORE_TRIM, problem)
    if problem is None:
        setattr(EngineCore, ENGINE_CORE_TRIM_METHOD, _malloc_trim)
