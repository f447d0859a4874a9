"""verl's teacher rows from our payload, against a plain loop over verl's own rule
(``extract_prompt_logprobs``: vLLM's prompt rows without the first, then a dummy row)."""

from __future__ import annotations

import numpy as np
import pytest

from topk_protocol.verl_layout import verl_rows

V, L, K_SERVED = 123, 47, 16


def _prompt_rows(dense: np.ndarray, tokens: np.ndarray) -> list[dict[int, tuple[float, int]]]:
    """vLLM's prompt log-probs as verl reads them: entry ``i >= 1`` is ``{id: (logprob,
    rank)}`` for the distribution of ``x[i]``, the actual token with its rank included."""
    rows: list[dict[int, tuple[float, int]]] = [{}]
    for i in range(1, len(tokens)):
        row = dense[i - 1]
        order = np.argsort(-row, kind="stable")
        ranks = {int(t): r + 1 for r, t in enumerate(order)}
        entry = {int(t): (float(row[t]), ranks[int(t)]) for t in order[:K_SERVED]}
        entry[int(tokens[i])] = (float(row[tokens[i]]), ranks[int(tokens[i])])
        rows.append(entry)
    return rows


def _verl_reference(rows: list[dict[int, tuple[float, int]]], k: int) -> tuple[list, list]:
    """verl 0.9.1's ``extract_prompt_logprobs``, written as a loop."""
    ids, lps = [], []
    for entry in rows[1:]:
        if k == 0:  # vLLM's one entry: the actual token
            token = next(iter(entry))
            ids.append([token])
            lps.append([entry[token][0]])
            continue
        row_ids, row_lps = [0] * k, [0.0] * k
        for t, (lp, r) in entry.items():
            if r <= k:
                row_ids[r - 1], row_lps[r - 1] = t, lp
        ids.append(row_ids)
        lps.append(row_lps)
    ids.append([0] * max(k, 1))
    lps.append([0.0] * max(k, 1))
    return ids, lps


@pytest.mark.parametrize("k", [0, 1, 8, K_SERVED])
@pytest.mark.parametrize("seed", range(3))
def test_rows_equal_verl_s_own_rule(k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(L, V)) * 3
    dense = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens = rng.integers(0, V, L)
    order = np.argsort(-dense, axis=-1, kind="stable")[:, :K_SERVED]
    ours_ids = order
    ours_lps = np.take_along_axis(dense, order, -1)
    sampled = np.append(dense[np.arange(L - 1), tokens[1:]], np.nan)

    ids, lps = verl_rows(tokens, ours_ids, ours_lps, sampled, k)

    rows = _prompt_rows(dense, tokens)
    if k == 0:  # verl's K = 0 reads the one entry vLLM returns: the actual token
        rows = [{}] + [{int(tokens[i]): rows[i][int(tokens[i])]} for i in range(1, L)]
    want_ids, want_lps = _verl_reference(rows, k)
    assert ids.dtype == np.int32 and lps.dtype == np.float32
    assert ids.shape == lps.shape == (L, max(k, 1))
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    np.testing.assert_allclose(lps, np.asarray(want_lps, np.float32), rtol=1e-6)


def test_a_sequence_of_one_token_is_one_dummy_row() -> None:
    ids, lps = verl_rows([4], [[1, 2]], [[-0.5, -1.0]], [np.nan], 2)
    assert ids.tolist() == [[0, 0]] and lps.tolist() == [[0.0, 0.0]]
