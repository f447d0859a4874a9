"""ms-swift's prompt log-probs from our payload, against vLLM's own entries (built here
from a dense distribution) as swift's ``parse_prompt_logprobs`` reads them (written as
its loop: the first entry for K = 0, the K largest log-probs for K > 0)."""

from __future__ import annotations

import numpy as np
import pytest

from topk_protocol.swift_layout import prompt_logprobs

V, L, K_SERVED = 123, 47, 16


def _vllm_entries(dense: np.ndarray, tokens: np.ndarray, k: int) -> list:
    """vLLM's ``prompt_logprobs=k`` for ``tokens``: entry ``p >= 1`` holds ``x[p]`` first,
    then the top ``k`` of its distribution, each with its true rank (``k = 0``: ``x[p]``)."""
    entries: list = [None]
    for p in range(1, len(tokens)):
        row = dense[p - 1]
        order = np.argsort(-row, kind="stable")
        rank = {int(t): r + 1 for r, t in enumerate(order)}
        token = int(tokens[p])
        entry = {str(token): {"logprob": float(row[token]), "rank": rank[token]}}
        for t in order[:k]:
            entry[str(int(t))] = {"logprob": float(row[t]), "rank": rank[int(t)]}
        entries.append(entry)
    return entries


def _swift_parse(entries: list, k: int) -> tuple[list, list]:
    """ms-swift 4.6.0's ``parse_prompt_logprobs``, as a loop over the entries."""
    lps, ixs = [], []
    for entry in entries[1:]:
        if k == 0:
            tid, info = next(iter(entry.items()))
            lps.append([info["logprob"]])
            ixs.append([int(tid)])
        else:
            items = sorted(entry.items(), key=lambda x: -x[1]["logprob"])[:k]
            lps.append([info["logprob"] for _, info in items])
            ixs.append([int(tid) for tid, _ in items])
    return lps, ixs


def _payload(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(L, V)) * 3
    dense = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    tokens = rng.integers(0, V, L)
    tokens[5] = np.argmax(dense[4])  # one actual token that is the most likely
    order = np.argsort(-dense, axis=-1, kind="stable")[:, :K_SERVED]
    sampled = np.append(dense[np.arange(L - 1), tokens[1:]], np.nan)
    return dense, tokens, order, np.take_along_axis(dense, order, -1), sampled


@pytest.mark.parametrize("k", [0, 1, 8, K_SERVED])
@pytest.mark.parametrize("seed", range(3))
def test_swift_reads_what_it_reads_from_vllm(k: int, seed: int) -> None:
    dense, tokens, ids, lps, sampled = _payload(seed)
    ours = prompt_logprobs(tokens, ids, lps, sampled, k)
    theirs = _vllm_entries(dense, tokens, k)
    assert len(ours) == L and ours[0] is None
    assert _swift_parse(ours, k) == _swift_parse(theirs, k)
    for mine, vllm in zip(ours[1:], theirs[1:], strict=True):
        assert list(mine) == list(vllm)  # the same ids in the same order, as strings
        for token, info in mine.items():
            assert info["logprob"] == vllm[token]["logprob"]
            assert info["rank"] in (None, vllm[token]["rank"])


@pytest.mark.parametrize("k", [0, 8])
def test_ranks_are_known_within_the_top_k_and_only_there(k: int) -> None:
    _, tokens, ids, lps, sampled = _payload(0)
    ours = prompt_logprobs(tokens, ids, lps, sampled, k)
    for p, entry in enumerate(ours[1:], start=1):
        for token, info in entry.items():
            within = int(token) in ids[p - 1, : max(k, 1)].tolist()
            assert (info["rank"] is not None) == within
    assert ours[5][str(tokens[5])]["rank"] == 1


def test_a_one_token_sequence_has_only_the_leading_none() -> None:
    assert prompt_logprobs([3], [[3, 1]], [[-0.1, -2.0]], [0.0], 2) == [None]
    assert prompt_logprobs([3], [[3, 1]], [[-0.1, -2.0]], [0.0], 0) == [None]
