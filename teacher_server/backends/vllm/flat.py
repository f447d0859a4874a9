"""vLLM's ``flat_logprobs`` path to payload arrays: the fallback where the array path
(:mod:`teacher_server.backends.vllm.array_logprobs`) does not check out on the installed vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol import SequenceArrays

__all__ = ["flat_payload", "flat_to_topk"]


def flat_to_topk(
    token_ids: list[int],
    logprobs: list[float],
    starts: list[int],
    ends: list[int],
    top_k: int,
    position_start: int = 0,
    ranks: list[int | None] | None = None,
) -> SequenceArrays:
    """Convert flat vLLM log-probs of ``P`` positions (from ``position_start``) into
    ``[P, K]`` arrays with numpy.

    Every position holds the actual next token first (with its true rank) and then the
    top-K; when the actual token is itself in the top-K, vLLM may have de-duplicated it, so
    a position holds K+1 or K entries. Returns ``ids`` ``[P, K]``, ``logprobs`` ``[P, K]``
    sorted descending, ``sampled_logprobs`` ``[P]`` (the actual token's) and, given the
    entries' ``ranks`` (vLLM's ``FlatLogprobs.ranks``), ``sampled_ranks`` ``[P]``.
    """
    n = len(starts)
    k = top_k
    if n == 0:
        return SequenceArrays.empty(k, position_start)
    st = np.asarray(starts, dtype=np.int64)
    cnt = np.asarray(ends, dtype=np.int64) - st
    base = st[0]
    tid = np.asarray(token_ids[base : ends[-1]], dtype=np.int32)
    lp = np.asarray(logprobs[base : ends[-1]], dtype=np.float32)
    st = st - base
    if np.any((cnt != k) & (cnt != k + 1)):
        bad = int(np.flatnonzero((cnt != k) & (cnt != k + 1))[0])
        raise RuntimeError(
            f"vLLM returned {cnt[bad]} log-prob entries at a position; expected {k} or {k + 1}"
        )
    actual = lp[st]
    actual_ranks = None if ranks is None else np.asarray(ranks[base : ends[-1]], np.int32)[st]
    # K+1 entries: skip the leading actual-token entry. K entries: it is one of the top-K.
    first = st + (cnt == k + 1)
    cols = first[:, None] + np.arange(k)[None, :]
    ids = tid[cols]
    vals = lp[cols]
    order = np.argsort(-vals, axis=1, kind="stable")
    return SequenceArrays(
        np.take_along_axis(ids, order, axis=1),
        np.take_along_axis(vals, order, axis=1),
        actual,
        position_start,
        sampled_ranks=actual_ranks,
    )


def flat_payload(
    out: Any, token_ids: npt.NDArray[np.int32], k: int, start: int, end: int
) -> SequenceArrays:
    """The payload of positions ``[start, end)`` of ``token_ids`` ``[L]`` from one
    ``RequestOutput`` ``out`` of vLLM's ``flat_logprobs`` path (``k`` entries a row)."""
    n = len(token_ids)
    pl = out.prompt_logprobs  # FlatLogprobs, row 0 empty
    # Payload positions [start, min(end, n-1)) come from prompt rows [start+1, ...).
    p_end = min(end, n - 1)
    rows = slice(start + 1, p_end + 1)
    head = flat_to_topk(
        pl.token_ids,
        pl.logprobs,
        pl.start_indices[rows],
        pl.end_indices[rows],
        k,
        start,
        pl.ranks,
    )
    if end < n:
        return head
    # The last position: the generated token's distribution (no next token: NaN).
    gl = out.outputs[0].logprobs
    last = flat_to_topk(
        gl.token_ids, gl.logprobs, gl.start_indices[:1], gl.end_indices[:1], k, n - 1, gl.ranks
    )
    nan = np.full(1, np.nan, np.float32)
    last = replace(last, sampled_logprobs=nan, sampled_ranks=np.zeros(1, np.int32))
    return SequenceArrays.concat([head, last])
