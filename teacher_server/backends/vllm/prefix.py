"""Prefix reuse for the vLLM backend: compute starts where the answer starts.

A request for payload positions ``[s, e)`` of a sequence needs the model's forward pass
at tokens ``s .. L-1`` only (row ``t`` is the distribution after token ``t``); the keys
and values of tokens ``0 .. s-1`` may come from vLLM's prefix cache. Two pieces make
that exact (docs/vllm.md, "Prefix reuse"):

- **The cap** (engine side). vLLM caches whole blocks of ``block_size`` tokens and, left
  alone, reads every cached block of a prompt, past the first position a request asks
  for; with prompt log-probs it reads none (``SamplingParams.skip_reading_prefix_cache``).
  The backend sets ``skip_reading_prefix_cache=False`` and puts
  :func:`cache_cap` (``floor(s / block_size) * block_size`` tokens) in the request's
  ``extra_args[`` :data:`CAP_KEY` ``]``; :class:`CappedScheduler`, vLLM's scheduler with
  one method overridden (engine argument ``scheduler_cls``), truncates every prefix-cache
  hit of such a request to that many tokens. vLLM's prompt log-prob rows of the cached
  positions are then never computed (they are uninitialised memory): the backend reads
  rows ``s ..`` only, and refuses an answer whose engine reports more cached tokens than
  ``s``.
- **The order** (front-end side, :class:`PrefixOrder`). vLLM reuses only blocks that are
  already computed: G requests that share a prompt and arrive together would all compute
  it. The backend keys every in-flight request by its block-aligned prefixes; a request
  whose readable prefix is being computed by an in-flight one (and is at least half of
  its sequence) waits for that one to finish, then reads the blocks it wrote. Unrelated
  requests share no key and never wait.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from teacher_server.backends.vllm.hooks import CAPPED_SCHEDULER, version_problem

__all__ = [
    "CAP_KEY",
    "SCHEDULER_QUALNAME",
    "CappedScheduler",
    "PrefixOrder",
    "block_keys",
    "cache_cap",
    "capped_hit",
    "scheduler_problem",
]

#: ``SamplingParams.extra_args`` key: the most prompt tokens the prefix cache may supply.
CAP_KEY = "topk_distill_cache_cap"

T = TypeVar("T")


def cache_cap(start: int, block_size: int) -> int:
    """Tokens a request for positions from ``start`` may read from a cache of whole
    ``block_size``-token blocks: ``floor(start / block_size) * block_size`` (never past
    ``start``: position ``start`` needs the forward pass at token ``start``)."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be > 0, got {block_size}")
    return (max(start, 0) // block_size) * block_size


def capped_hit(hit_tokens: int, cap: int | None, block_size: int) -> int:
    """The prefix-cache hit a request may use: ``hit_tokens`` (what vLLM found) cut to
    ``cap`` rounded down to whole blocks; ``cap`` None: no cap (vLLM's own hit)."""
    if cap is None:
        return hit_tokens
    return min(hit_tokens, cache_cap(cap, block_size))


def _cap_of(request: Any) -> int | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    cap = extra.get(CAP_KEY)
    return None if cap is None else int(cap)


def _capped_class(base: type) -> type:
    class Capped(base):
        """vLLM's scheduler whose prefix-cache hits stop at each request's cap."""

        def _get_local_prefix_cache_hit(self, request: Any) -> Any:
            blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
            allowed = capped_hit(hit, _cap_of(request), self.block_size)
            if allowed < hit:
                blocks = self.kv_cache_manager.truncate_computed_blocks(blocks, allowed)
                hit, boundary = allowed, boundary if boundary <= allowed else 0
            return blocks, hit, boundary, diverged

    Capped.__name__ = Capped.__qualname__ = f"Capped{base.__name__}"
    return Capped


class CappedScheduler:
    """vLLM's scheduler (the async one where the engine schedules asynchronously) with
    every prefix-cache hit cut to the request's :data:`CAP_KEY`; requests without it get
    vLLM's own hit. Pass as ``scheduler_cls`` (:data:`SCHEDULER_QUALNAME`): constructing
    it builds the subclass of the scheduler vLLM would have used."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        config = kwargs.get("vllm_config", args[0] if args else None)
        use_async = bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", 0))
        return _capped_class(AsyncScheduler if use_async else Scheduler)(*args, **kwargs)


#: Value of vLLM's ``scheduler_cls`` engine argument.
SCHEDULER_QUALNAME = f"{__name__}.{CappedScheduler.__qualname__}"


def scheduler_problem() -> str | None:
    """Why :class:`CappedScheduler` cannot be used with the installed vLLM (a version it
    was not written for, or a scheduler without the method it overrides), or None
    (:data:`~teacher_server.backends.vllm.hooks.CAPPED_SCHEDULER`)."""
    if (problem := version_problem(CAPPED_SCHEDULER)) is not None:
        return problem
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:
        return f"vLLM's V1 scheduler cannot be imported ({exc})"
    if not callable(getattr(Scheduler, "_get_local_prefix_cache_hit", None)):
        return "vLLM's scheduler has no _get_local_prefix_cache_hit to cap"
    return None


def block_keys(token_ids: npt.NDArray[np.int32], block_size: int, blocks: int) -> list[bytes]:
    """``[blocks]`` keys: key ``i`` names the prefix ``token_ids[: (i + 1) * block_size]``
    (a chained digest: equal keys, equal prefixes, up to blake2b collisions; only the order
    of requests depends on it, never a payload)."""
    data = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    step = 4 * block_size
    h = hashlib.blake2b(digest_size=16)
    keys = []
    for i in range(blocks):
        h.update(data[i * step : (i + 1) * step])
        keys.append(h.copy().digest())
    return keys


class PrefixOrder:
    """Orders requests that share a block-aligned prefix (one per backend).

    :meth:`run` submits a request at once unless an in-flight request is computing a
    prefix this one may read (its cap) and that prefix is at least half of this one's
    tokens: then it waits until that request has finished (its blocks are cached), and
    is submitted after. A request becomes the producer of the full blocks of its tokens
    that no in-flight request produces yet, from submission until it ends (answered,
    failed or cancelled: waiters never wait longer than their producer). Blocks that a
    request answered recently (the last ``remember`` keys) count as cached: a request
    reading them produces nothing new there, so nobody waits on it for them (if vLLM
    evicted them meanwhile, they are recomputed: slower, never wrong)."""

    def __init__(self, block_size: int, remember: int = 65536) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self.block_size = block_size
        self._producing: dict[bytes, asyncio.Event] = {}
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        #: Requests that waited for a sibling's prefix (count, for tests and logs).
        self.waited = 0

    def producer_of(self, keys: list[bytes], readable: int) -> asyncio.Event | None:
        """The in-flight producer of the longest of the first ``readable`` block keys
        worth waiting for, or None (see the class doc)."""
        for i in range(readable - 1, -1, -1):
            event = self._producing.get(keys[i])
            if event is not None:
                return event
        return None

    async def run(
        self,
        token_ids: npt.NDArray[np.int32],
        start: int,
        submit: Callable[[], Awaitable[T]],
        prefill: Callable[[int], Awaitable[object]] | None = None,
    ) -> T:
        """``await submit()`` in prefix order (see the class doc) for a request of
        ``token_ids`` (``[L]``) whose positions start at ``start``.

        ``prefill(n)``: computes the first ``n`` tokens alone (a forward pass without
        log-probs). A request that would compute its readable prefix itself (nobody in
        flight or recently did) calls it first, and its waiters go as soon as that prefix
        is cached: the G requests of a group then run together, and no log-prob row is
        computed for a prompt position nobody asked for."""
        bs, length = self.block_size, len(token_ids)
        readable = cache_cap(start, bs) // bs
        # Blocks this request writes: the full blocks of its prompt.
        keys = block_keys(token_ids, bs, length // bs)
        shared = self.producer_of(keys, readable) if 2 * readable * bs >= length else None
        if shared is not None:
            self.waited += 1
            await shared.wait()
        head_done, done = asyncio.Event(), asyncio.Event()
        new = [k for k in keys if k not in self._producing and k not in self._recent]
        head = [k for k in new if k in set(keys[:readable])] if prefill is not None else []
        tail = [k for k in new if k not in set(head)]
        for ks, event in ((head, head_done), (tail, done)):
            for k in ks:
                self._producing[k] = event
        answered = False
        try:
            if head and prefill is not None:
                try:
                    await prefill(readable * bs)
                    self._remember_keys(head)
                finally:
                    for k in head:
                        del self._producing[k]
                    head_done.set()
            got = await submit()
            answered = True
            return got
        finally:
            for k in tail:
                del self._producing[k]
            if answered:
                self._remember_keys(tail)
            head_done.set()
            done.set()

    def _remember_keys(self, keys: list[bytes]) -> None:
        for k in keys:
            self._recent[k] = None
            self._recent.move_to_end(k)
        while len(self._recent) > self._remember:
            self._recent.popitem(last=False)
