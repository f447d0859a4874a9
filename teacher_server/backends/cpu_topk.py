"""Top-k of many short rows on a CPU, without branch-heavy selection.

vLLM's engine computes the log-probs it returns as one ``[rows, V]`` float32 tensor per
request and then calls ``torch.topk`` on it. On a CPU that top-k is the largest part of
the log-prob cost: a partial sort per row whose branches the processor cannot predict
(vLLM's ``gather_logprobs`` takes 2.6 us per row at K = 64, V = 512, one thread, best of
10, in ``benchmarks/bench_cpu_topk.py``, and 5.6 per position inside vLLM's worker in
``benchmarks/profile_engine.py``: over half of the tiny test model's forward pass).
:func:`topk_with_target` returns what vLLM's ``gather_logprobs`` returns, from a
numba kernel that does the same job with counting passes that vectorize:

1. two passes: the target's rank (``count(row >= row[t])``) and a finiteness check, then
   the row's min and max (as order-preserving integers: float min / max reductions do
   not vectorize);
2. counting passes: ``NUM_THRESHOLDS`` thresholds spread over ``[lo, hi)``, counted in
   one vectorized loop each; ``lo`` moves up to the highest threshold that still keeps
   ``>= K`` entries, ``hi`` down to the next one, until at most ``K + SLACK`` entries are
   ``>= lo`` (or the bracket cannot shrink: ties);
3. the entries ``>= lo`` are compacted (in id order) and each is placed at its rank among
   them, found by comparing a 64-bit key (value, then lower id first) with every other
   candidate: ``c**2`` compares for ``c <= K + SLACK`` candidates, again vectorized.

The values are copied, never recomputed, so they are bit-identical to the input; ties
come out in ascending id order (``torch.topk`` leaves their order unspecified). Written
here because no library offers a batched CPU top-k that also returns the target's rank;
numba is already installed with vLLM's CPU build.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["MAX_K_FRACTION", "NUM_THRESHOLDS", "SLACK", "supported", "topk_with_target"]

#: Thresholds counted per pass over a row.
NUM_THRESHOLDS = 8
#: Counting stops once at most ``K + SLACK`` entries are candidates.
SLACK = 8
#: The kernel serves ``K <= V // MAX_K_FRACTION``; beyond that the candidate sort costs
#: ``K**2`` per row and ``torch.topk`` is faster (measured: K = 300 of V = 512).
MAX_K_FRACTION = 4


def supported(scores: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_with_target` serves ``scores`` (``[N, V]``): a CPU float32
    2-D tensor with ``1 <= k <= V // MAX_K_FRACTION``."""
    return (
        scores.device.type == "cpu"
        and scores.dtype == torch.float32
        and scores.dim() == 2
        and 1 <= k <= scores.shape[1] // MAX_K_FRACTION
    )


def topk_with_target(
    scores: torch.Tensor, k: int, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's target entry, its top-``k`` entries and the target's rank.

    Args:
        scores: ``[N, V]`` float32 CPU (log-probs or logits; see :func:`supported`).
        k: entries per row, ``1 <= k <= V // MAX_K_FRACTION``.
        target_ids: ``[N]`` integer ids in ``[0, V)``.

    Returns:
        ``(ids [N, k+1] int32, values [N, k+1] float32, ranks [N] int64)``: column 0 the
        target (its id and value), columns ``1..k`` the top-``k`` in descending order
        (ties: lower id first); ``ranks[i] = count(scores[i] >= scores[i, target_ids[i]])``
        (1 = the target is the largest). ``None`` when a row holds a value that is not
        finite: ``torch.topk`` defines where NaN and infinities go; use it then.

    Raises:
        ValueError: ``scores`` is not supported, or ``target_ids`` has the wrong shape or
            an id outside ``[0, V)``.
    """
    if not supported(scores, k):
        raise ValueError(
            f"scores: need a float32 CPU [N, V] tensor and 1 <= k <= V // "
            f"{MAX_K_FRACTION}; got {scores.dtype} {tuple(scores.shape)} on "
            f"{scores.device}, k = {k}"
        )
    n, v = scores.shape
    tgt = target_ids.reshape(-1).to(torch.int64)
    if tgt.shape[0] != n:
        raise ValueError(f"target_ids: expected {n} ids, got {tuple(target_ids.shape)}")
    if n and (int(tgt.min()) < 0 or int(tgt.max()) >= v):
        raise ValueError(f"target_ids: ids must lie in [0, {v})")
    ids = torch.empty((n, k + 1), dtype=torch.int32)
    values = torch.empty((n, k + 1), dtype=torch.float32)
    ranks = torch.empty(n, dtype=torch.int64)
    if n:
        _set_threads()
        args = (scores.contiguous(), tgt, ids, values, ranks)
        finite = _topk_rows(*(a.numpy() for a in args[:2]), k, *(a.numpy() for a in args[2:]))
        if not finite:
            return None
    return ids, values, ranks


def _set_threads() -> None:
    """As many numba threads as torch uses here (vLLM's CPU worker pins torch's)."""
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _shrink(row, in_row, cand_v, cand_i, c, lo):
    """Keep the pool's entries ``>= lo`` (in id order) in ``cand_v`` / ``cand_i``; the pool
    is the whole ``row`` if ``in_row``, else ``cand_v`` / ``cand_i [:c]``. Returns its size."""
    w = np.int64(0)
    if in_row:
        for j in range(row.shape[0]):
            x = row[j]
            cand_v[w] = x
            cand_i[w] = j
            w += np.int64(x >= lo)
    else:
        for j in range(c):
            x = cand_v[j]
            d = cand_i[j]
            cand_v[w] = x
            cand_i[w] = d
            w += np.int64(x >= lo)
    return w


_HELPER = {"cache": True, "nogil": True, "boundscheck": False, "inline": "always"}


@numba.njit(**_HELPER)
def _rank_of(row, tv):
    """``(count(row >= tv), count of non-finite entries)`` of one row, in one pass."""
    rank = np.int32(0)
    nonfinite = np.int32(0)
    for j in range(row.shape[0]):
        x = row[j]
        rank += np.int32(x >= tv)
        nonfinite += np.int32(x - x != 0)  # inf - inf and NaN - NaN are NaN
    return rank, nonfinite


@numba.njit(**_HELPER)
def _min_max(row, minmax):
    """``(min, max)`` of a finite row, found as integers (float min / max reductions do not
    vectorize): the order-preserving int32 of a float's bits, and back (the map is its own
    inverse). ``minmax``: an int32 ``[2]`` scratch buffer."""
    bits = row.view(np.int32)
    k_hi = np.int32(-2147483648)
    k_lo = np.int32(2147483647)
    for j in range(row.shape[0]):
        b_ = bits[j]
        key_ = b_ ^ ((b_ >> 31) & np.int32(0x7FFFFFFF))
        k_hi = max(k_hi, key_)
        k_lo = min(k_lo, key_)
    minmax[0] = k_lo ^ ((k_lo >> 31) & np.int32(0x7FFFFFFF))
    minmax[1] = k_hi ^ ((k_hi >> 31) & np.int32(0x7FFFFFFF))
    minmax_f = minmax.view(np.float32)
    return minmax_f[0], minmax_f[1]


@numba.njit(**_HELPER)
def _candidates(row, k, lo, hi, cand_v, cand_i, th, cnt):
    """Narrow ``[lo, hi]`` by rounds of :data:`NUM_THRESHOLDS` thresholds until at most
    ``k + SLACK`` entries are ``>= lo`` (``count(row >= lo) >= k`` always holds), or no
    float is left between the bounds (ties at the threshold). The pool is written to
    ``cand_v`` / ``cand_i [:c]`` (in id order); returns ``c``."""
    v = row.shape[0]
    c_lo = v
    c = np.int64(0)
    in_row = True
    while c_lo > k + SLACK:
        step = (hi - lo) / (NUM_THRESHOLDS + 1)
        for m in range(NUM_THRESHOLDS):
            x = lo + step * (m + 1)
            th[m] = x
            cm = np.int32(0)
            if in_row:
                for j in range(v):
                    cm += np.int32(row[j] >= x)
            else:
                for j in range(c):
                    cm += np.int32(cand_v[j] >= x)
            cnt[m] = cm
        new_lo, new_c, new_hi = lo, c_lo, hi
        for m in range(NUM_THRESHOLDS):
            if cnt[m] >= k:
                new_lo, new_c = th[m], cnt[m]
            else:
                new_hi = th[m]
                break
        if new_lo == lo and new_hi == hi:
            break  # no float left between them: ties at the threshold
        lo, c_lo, hi = new_lo, new_c, new_hi
        c = _shrink(row, in_row, cand_v, cand_i, c, lo)
        in_row = False
    if in_row:
        c = _shrink(row, in_row, cand_v, cand_i, c, lo)
    return c


@numba.njit(**_HELPER)
def _write_top(cand_v, cand_i, cand_key, c, k, out_vals, out_ids):
    """Write the pool's ``k`` largest (``cand_v`` / ``cand_i [:c]``), sorted, to
    ``out_vals`` / ``out_ids [1 : k + 1]`` of one row: each entry's place is the count of
    entries ranked above it. Key: the float's bits made order-preserving as a signed int,
    then the id reversed so that a lower id ranks first among equal values."""
    for a in range(c):
        bits = np.int64(np.float32(cand_v[a] + np.float32(0.0)).view(np.int32))
        if bits < 0:  # (adding +0.0 above turned -0.0 into +0.0: they tie)
            bits = bits ^ 0x7FFFFFFF
        cand_key[a] = (bits << 32) + (0xFFFFFFFF - np.int64(cand_i[a]))
    for a in range(c):
        key = cand_key[a]
        r = np.int32(0)
        for q in range(c):
            r += np.int32(cand_key[q] > key)
        if r < k:
            out_vals[1 + r] = cand_v[a]
            out_ids[1 + r] = cand_i[a]


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _topk_rows(lp, tgt, k, out_ids, out_vals, ranks):
    """The kernel (see the module docstring): writes ``out_ids``, ``out_vals``, ``ranks``
    and returns whether every value was finite (rows that are not are left unfinished)."""
    n, v = lp.shape
    blocks = min(n, 256)
    bad = np.zeros(blocks, np.int32)
    for b in numba.prange(blocks):
        cand_v = np.empty(v, np.float32)
        cand_i = np.empty(v, np.int32)
        cand_key = np.empty(v, np.int64)
        th = np.empty(NUM_THRESHOLDS, np.float32)
        cnt = np.empty(NUM_THRESHOLDS, np.int32)
        minmax = np.empty(2, np.int32)
        for i in range(b * n // blocks, (b + 1) * n // blocks):
            row = lp[i]
            t = tgt[i]
            tv = row[t]
            rank, nonfinite = _rank_of(row, tv)
            lo, hi = _min_max(row, minmax)
            if nonfinite:
                bad[b] += 1
                continue
            ranks[i] = rank
            out_vals[i, 0] = tv
            out_ids[i, 0] = t
            c = _candidates(row, k, lo, hi, cand_v, cand_i, th, cnt)
            _write_top(cand_v, cand_i, cand_key, c, k, out_vals[i], out_ids[i])
    return bad.sum() == 0
