"""Comparing two top-K answers for the same rows that may differ by float rounding (two
engines, two CPUs, vLLM against the transformers reference), without claiming more than
rounding allows.

If every log-prob of one answer is within ``drift`` of the other's, two entries whose
log-probs are more than ``2 * drift`` apart keep their order, and two that are closer may
swap. So: log-probs within ``drift`` everywhere, and ids equal only where the rank is
unambiguous, i.e. where the entry is more than ``2 * drift`` from both neighbours, the
one ranked below included (the first entry outside the top-K for the last column: known
when ``want`` carries one more column than ``got``; unknown otherwise, and that column's
ids are then not compared).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["FLOAT32_DRIFT", "MIN_COMPARED", "assert_same_topk", "unambiguous_ranks"]

#: Below this fraction of ids compared, the rows are too flat for the check to mean much.
MIN_COMPARED = 0.9

#: vLLM's float32 log-probs of the tiny test model, up to 1000 tokens, against another
#: float32 computation of the same weights: the transformers forward pass, or the same
#: engine on another CPU (other SIMD kernels: another order of the same float32 sums).
FLOAT32_DRIFT = 1e-4


def unambiguous_ranks(
    logprobs: npt.NDArray[np.floating],
    k: int,
    drift: float,
    min_compared: float = MIN_COMPARED,
) -> npt.NDArray[np.bool_]:
    """``[S, k]`` bool: entry ``(s, j)`` of ``logprobs`` (``[S, K']``, sorted descending
    per row, ``K' >= k``) is more than ``2 * drift`` from the entries ranked just above and
    just below it (the last column ``k - 1`` only if ``K' > k``: its lower neighbour is
    known). Asserts that this holds for at least ``min_compared`` of the entries whose
    lower neighbour is known (fewer: the rows are too flat for an id comparison to mean
    much)."""
    gaps = -np.diff(logprobs[:, : k + 1], axis=1) > 2 * drift  # [S, min(K', k + 1) - 1]
    judged = gaps.shape[1]  # the columns whose lower neighbour is known
    clear = np.zeros((logprobs.shape[0], k), dtype=bool)
    clear[:, :judged] = gaps
    clear[:, 1:] &= gaps[:, : k - 1]
    if judged and logprobs.shape[0]:
        share = clear[:, :judged].mean()
        assert share >= min_compared, (
            f"only {share:.1%} of the ranks are more than 2 x {drift:g} apart: rows too "
            "flat for a meaningful id comparison"
        )
    return clear


def assert_same_topk(
    got_ids: npt.NDArray[np.integer],
    got_logprobs: npt.NDArray[np.floating],
    want_ids: npt.NDArray[np.integer],
    want_logprobs: npt.NDArray[np.floating],
    drift: float,
    *,
    clear: npt.NDArray[np.bool_] | None = None,
) -> None:
    """``got`` (``[S, K]``) equals ``want`` (``[S, K']``, ``K' >= K``: one more column
    lets the last column's ids be compared) up to ``drift`` per log-prob: log-probs within
    ``drift`` everywhere, ids wherever the rank is unambiguous (``clear``, ``[S, K]``;
    default :func:`unambiguous_ranks` of ``want`` with ``drift``)."""
    s, k = got_ids.shape
    assert want_ids.shape[0] == s and want_ids.shape[1] >= k, (got_ids.shape, want_ids.shape)
    np.testing.assert_allclose(got_logprobs, want_logprobs[:, :k], atol=drift, rtol=0)
    if clear is None:
        clear = unambiguous_ranks(want_logprobs, k, drift)
    np.testing.assert_array_equal(got_ids[clear], want_ids[:, :k][clear])
