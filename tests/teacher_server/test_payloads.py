"""Pure conversions of the backends: vLLM flat log-probs -> arrays, dense -> top-k (the
packing of answers is tested in ``test_answers.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from teacher_server.backends.base import topk_from_logprobs
from teacher_server.backends.vllm.flat import flat_to_topk


def test_flat_to_topk_handles_k_and_k_plus_1_entries() -> None:
    k = 3
    # Position 0: actual token 9 outside the top-3 -> K+1 entries, actual first.
    # Position 1: actual token 5 inside the top-3 and de-duplicated -> K entries.
    # Position 2: K+1 entries where the actual token repeats inside the top-k.
    token_ids = [9, 1, 2, 3, 5, 4, 6, 7, 7, 8, 2]
    logprobs = [-9.0, -0.5, -1.0, -2.0, -1.5, -0.7, -3.0, -0.2, -0.2, -0.9, -1.1]
    starts, ends = [0, 4, 7], [4, 7, 11]
    # Deliberately offset the flat lists, as a slice of a longer FlatLogprobs would be.
    pad = [0] * 5
    out = flat_to_topk(
        pad + token_ids, [0.0] * 5 + logprobs, [s + 5 for s in starts], [e + 5 for e in ends], k, 7
    )
    ids, lps, actual = out.ids, out.logprobs, out.sampled_logprobs
    assert out.position_start == 7
    np.testing.assert_array_equal(ids, [[1, 2, 3], [4, 5, 6], [7, 8, 2]])
    np.testing.assert_allclose(lps[0], [-0.5, -1.0, -2.0])
    np.testing.assert_allclose(lps[1], [-0.7, -1.5, -3.0])
    np.testing.assert_allclose(lps[2], [-0.2, -0.9, -1.1])
    np.testing.assert_allclose(actual, [-9.0, -1.5, -0.2])
    assert np.all(np.diff(lps, axis=1) <= 0)


def test_flat_to_topk_rejects_wrong_entry_count() -> None:
    with pytest.raises(RuntimeError, match="expected 3 or 4"):
        flat_to_topk([1, 2], [-1.0, -2.0], [0], [2], 3)


def test_flat_to_topk_empty() -> None:
    out = flat_to_topk([], [], [], [], 5, 3)
    assert out.ids.shape == (0, 5) and out.logprobs.shape == (0, 5) and out.position_start == 3
    assert out.sampled_logprobs is not None and out.sampled_logprobs.shape == (0,)


def test_topk_from_logprobs_alignment() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    tokens = rng.integers(0, 50, size=6).astype(np.int32)
    out = topk_from_logprobs(lp, tokens, 4)
    np.testing.assert_array_equal(out.ids, np.argsort(-lp, axis=1)[:, :4])
    assert out.sampled_logprobs is not None
    np.testing.assert_allclose(out.sampled_logprobs[:-1], lp[np.arange(5), tokens[1:]])
    assert np.isnan(out.sampled_logprobs[-1])
