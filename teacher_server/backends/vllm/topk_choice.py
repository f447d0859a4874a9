"""Which top-k a CPU vLLM engine serves its log-prob rows with (``--engine-topk``).

``vllm`` keeps vLLM's own ``gather_logprobs`` (``torch.topk``); ``kernel`` requires this
project's CPU kernel (:mod:`teacher_server.backends.vllm.worker`) and fails at start-up
without it; ``auto`` (the default) installs the kernel where its correctness self-check
passes and then keeps the faster of the two: every worker times both on one batch of
rows at the served vocabulary and the largest K served
(:func:`~teacher_server.backends.vllm.worker.time_gather`), and
:func:`choose_by_speed` picks from those timings. Which one wins depends on the CPU and
the vocabulary: the kernel's counting passes win on small vocabularies, ``torch.topk``
can win at V = 151,936 (docs/benchmarks.md, CPU top-k kernel). The choice and its
timings are logged at start-up. On a GPU engine ``auto`` is vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from teacher_server.backends.vllm.hooks import ENGINE_TOPK_KERNEL, report
from teacher_server.backends.vllm.worker import (
    ENGINE_TOPK_METHOD,
    KERNEL,
    TIME_TOPK_METHOD,
    VLLM_TOPK,
)

__all__ = ["TopkChoice", "choose_by_speed", "route_engine_topk", "start_up_choice"]


@dataclass(frozen=True)
class TopkChoice:
    """The engine top-k in use (:data:`KERNEL` or :data:`VLLM_TOPK`) and why."""

    name: str
    reason: str


def choose_by_speed(per_worker: Sequence[Sequence[float]], vocab: int, k: int) -> TopkChoice:
    """The faster top-k from each worker's ``[vLLM's, kernel's]`` seconds per row at
    vocabulary ``vocab`` and ``K = k``: the one with the smaller sum over workers (every
    engine step waits for its slowest worker, and they all do the same work); the kernel
    on a tie. A worker without two finite, positive timings leaves the kernel in place
    (it passed its self-check; the timing says nothing)."""
    where = f"V = {vocab:,}, K = {k}"
    if not per_worker or any(
        len(t) != 2 or not all(math.isfinite(x) and x > 0 for x in t) for t in per_worker
    ):
        return TopkChoice(KERNEL, f"the kernel (its timing at {where} gave no figures)")
    stock = sum(t[0] for t in per_worker) / len(per_worker) * 1e6
    kernel = sum(t[1] for t in per_worker) / len(per_worker) * 1e6
    timings = f"{kernel:.2f} us/row against vLLM's {stock:.2f} at {where}"
    if kernel <= stock:
        return TopkChoice(KERNEL, f"the kernel is faster: {timings}")
    return TopkChoice(VLLM_TOPK, f"vLLM's torch.topk is faster: the kernel takes {timings}")


async def route_engine_topk(engine: Any, use_kernel: bool) -> list[str]:
    """Route every worker's log-prob top-k to the CPU kernel (``use_kernel``) or to
    vLLM's own; each worker's answer (``kernel``, ``vllm`` or ``unavailable: <why>``)."""
    answers = await engine.collective_rpc(ENGINE_TOPK_METHOD, args=(use_kernel,))
    return [str(a) for a in answers]


async def start_up_choice(
    engine: Any, requested: str, own_extension: bool, k: int, version_problem: str | None
) -> TopkChoice:
    """Route ``engine``'s workers for ``--engine-topk requested`` (``auto``, ``kernel`` or
    ``vllm``) and return what is in use. ``own_extension``: this project's worker class
    is installed; ``k``: the largest K served; ``version_problem``: why the installed
    vLLM is not the one the kernel's wrapper was written for (None: it is). The kernel's
    hook is reported installed or fallen back
    (:func:`~teacher_server.backends.vllm.hooks.report`)."""
    from vllm.platforms import current_platform

    auto, on_cpu = requested == "auto", current_platform.is_cpu()
    if requested == VLLM_TOPK:
        return TopkChoice(VLLM_TOPK, "--engine-topk vllm")
    if auto and not on_cpu:
        return TopkChoice(VLLM_TOPK, "vLLM's (the engine does not run on a CPU)")
    if not own_extension:
        return TopkChoice(VLLM_TOPK, "vLLM's (worker_extension_cls is set by the caller)")
    if auto and version_problem:
        report(ENGINE_TOPK_KERNEL, version_problem)
        return TopkChoice(VLLM_TOPK, f"vLLM's: {version_problem}")
    answers = await route_engine_topk(engine, True)
    if not all(a == KERNEL for a in answers):
        await route_engine_topk(engine, False)
        why = "; ".join(sorted({a for a in answers if a != KERNEL}))
        if requested == KERNEL:
            raise RuntimeError(f"engine_topk kernel: the CPU top-k kernel cannot be used: {why}")
        report(ENGINE_TOPK_KERNEL, why)
        return TopkChoice(VLLM_TOPK, f"vLLM's: {why}")
    report(ENGINE_TOPK_KERNEL, None)
    if requested == KERNEL:
        return TopkChoice(KERNEL, "--engine-topk kernel")
    timings = await engine.collective_rpc(TIME_TOPK_METHOD, args=(k,))
    vocab = int(engine.model_config.get_vocab_size())
    choice = choose_by_speed([list(t) for t in timings], vocab, k)
    if choice.name == VLLM_TOPK:
        await route_engine_topk(engine, False)
    return choice
