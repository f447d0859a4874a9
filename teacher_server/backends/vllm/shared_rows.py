"""Rows shared between requests: a prompt's payload rows computed once for a group.

Prefix reuse (:mod:`teacher_server.backends.vllm.prefix`) saves the forward pass of the
tokens *before* a request's first position. A request for every position (``s = 0``)
gains nothing from it, and that is how slime and miles score a group: G requests, one per
completion, each the prompt and its completion with ``logprob_start_len = 0``. Their
prompt rows are the same: row ``t`` is the distribution after ``x[: t + 1]``, and its
actual-token log-prob is at ``x[t + 1]``, so two sequences whose first ``P`` tokens agree
have equal rows ``0 .. P - 2``.

:class:`SharedRows` keeps the rows of recent answers (least recently used first out, at
most ``max_bytes``), found by the chained digests of their block-aligned prefixes
(:func:`~teacher_server.backends.vllm.prefix.block_keys`). A request for rows ``[s, e)``
that shares ``P`` tokens with a kept answer whose rows start at or before ``s`` takes
rows ``[s, s')`` from it (``s' = min(e, P - 1)``, the answer's end too) and asks the
engine for ``[s', e)`` only, which reads the keys and values before ``s'`` from vLLM's
prefix cache (the cap, :func:`~teacher_server.backends.vllm.prefix.cache_cap`). G
requests that arrive together would each compute the prompt: a request whose first half
(or more) of tokens, in whole blocks, is the prefix of a request in flight waits for that
one to be answered first, as :class:`~teacher_server.backends.vllm.prefix.PrefixOrder`
waits for a cached prefix. Requests that share no block never wait.

Only plain top-k requests share (no candidates, no sampled payload), and only at the same
K: the kept rows are the engine's float32 rows before the wire's dtype or packing, so a
shared row is the row the engine gave the first request (docs/vllm.md, "Prefix reuse").
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from teacher_server.backends.vllm.prefix import block_keys
from teacher_server.validation import ParsedSequence
from topk_protocol import SequenceArrays

__all__ = ["DEFAULT_SHARED_ROWS_BYTES", "SharedRows"]

#: Bytes of kept rows by default: about 64 sequences of 2,048 rows at K = 64, or 5,000
#: at K = 1 (slime's call without top-k).
DEFAULT_SHARED_ROWS_BYTES = 64 << 20


@dataclass(frozen=True)
class _Kept:
    """One kept answer: its sequence ``[L]``, its rows, the key of the options they were
    computed with, its block keys and its size."""

    token_ids: npt.NDArray[np.int32]
    rows: SequenceArrays
    options: Hashable
    keys: tuple[bytes, ...]
    nbytes: int


def _common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class SharedRows:
    """Rows of recent answers, shared with later requests for the same prefix (one per
    backend; see the module doc).

    Args:
        block_size: vLLM's KV cache block, in tokens (the unit of the prefix digests).
        max_bytes: the most bytes of rows kept (> 0).
    """

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_SHARED_ROWS_BYTES) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # by id(), oldest first
        self._by_key: dict[bytes, _Kept] = {}  # block key -> an answer holding it
        self._bytes = 0
        self._producing: dict[bytes, asyncio.Event] = {}
        #: Rows answered from kept answers, and requests that waited for a sibling.
        self.rows_shared = 0
        self.waited = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of rows kept now."""
        return self._bytes

    def _producer(self, keys: list[bytes], length: int) -> asyncio.Event | None:
        """The in-flight request computing the longest of ``keys`` that covers at least
        half of a ``length``-token sequence, or None."""
        for i in range(len(keys) - 1, -1, -1):
            if 2 * (i + 1) * self.block_size < length:
                return None
            event = self._producing.get(keys[i])
            if event is not None:
                return event
        return None

    def clear(self) -> None:
        """Forget every kept answer (the server does when quiet, before giving memory
        back: a group's requests come together, not across quiet spells)."""
        self._kept.clear()
        self._by_key.clear()
        self._bytes = 0

    def _lookup(
        self, sequence: ParsedSequence, keys: list[bytes], options: Hashable
    ) -> tuple[_Kept, int, bool] | None:
        """The kept answer to share rows from, the position ``s'`` its rows end at for
        ``sequence`` and whether ``sequence`` is a prefix of the kept one's (then its
        answer adds nothing worth keeping), or None (nothing worth a block)."""
        for key in reversed(keys):
            kept = self._by_key.get(key)
            if kept is None or kept.options != options:
                continue
            rows = kept.rows
            end = rows.position_start + len(rows.ids)
            shared = _common_prefix(sequence.token_ids, kept.token_ids)
            until = min(sequence.end, shared - 1, end)
            if rows.position_start <= sequence.start and until - sequence.start >= self.block_size:
                return kept, until, shared == len(sequence.token_ids)
            return None
        return None

    async def score(
        self,
        sequence: ParsedSequence,
        options: Hashable,
        compute: Callable[[ParsedSequence], Awaitable[SequenceArrays]],
    ) -> SequenceArrays:
        """The rows ``[start, end)`` of ``sequence`` (no candidates): from a kept answer
        computed with the same ``options`` where one shares its prefix, the rest by
        ``compute`` (the backend's own scoring of a sequence with a later start)."""
        tokens = sequence.token_ids
        keys = block_keys(tokens, self.block_size, len(tokens) // self.block_size)
        producer = self._producer(keys, len(tokens))
        if producer is not None:
            self.waited += 1
            await producer.wait()
        done = asyncio.Event()
        mine = [k for k in keys if k not in self._producing]
        for k in mine:
            self._producing[k] = done
        try:
            hit = self._lookup(sequence, keys, options)
            if hit is None:
                rows = await compute(sequence)
            else:
                kept, until, within = hit
                head = kept.rows.positions(sequence.start, until)
                self._touch(kept)
                self.rows_shared += until - sequence.start
                if until == sequence.end:
                    return head  # nothing new to keep
                tail = await compute(replace(sequence, start=until))
                rows = SequenceArrays.concat([head, tail])
                if within:  # the kept answer holds this prefix already (a repeat)
                    return rows
            self._keep(tokens, rows, options, keys)
            return rows
        finally:
            for k in mine:
                del self._producing[k]
            done.set()

    def _touch(self, kept: _Kept) -> None:
        self._kept.move_to_end(id(kept))

    def _keep(
        self,
        tokens: npt.NDArray[np.int32],
        rows: SequenceArrays,
        options: Hashable,
        keys: list[bytes],
    ) -> None:
        rows = rows.copy()  # the rows may be views of a larger engine buffer
        nbytes = tokens.nbytes + rows.nbytes
        if nbytes > self.max_bytes or not keys:
            return
        kept = _Kept(tokens.copy(), rows, options, tuple(keys), nbytes)
        self._kept[id(kept)] = kept
        self._bytes += nbytes
        for k in keys:
            # A key names the answer whose rows start first (the newest of those).
            there = self._by_key.get(k)
            if there is None or there.rows.position_start >= rows.position_start:
                self._by_key[k] = kept
        while self._bytes > self.max_bytes:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.nbytes
            for k in old.keys:
                if self._by_key.get(k) is old:
                    del self._by_key[k]
