"""vLLM's ``/v1/completions`` and ``/inference/v1/generate`` answers as the vectorized
renderer writes them, against the per-entry reference
(:mod:`benchmarks.json_render_reference`), without an engine: the same JSON once every
float is read as float32, and the same bytes apart from how the floats are written
(and the answer's own id and time), on odd shapes (S in {0, 1, 3, 47}, K in {1, 5,
64}, ``prompt_logprobs`` below the engine's K), the prompt token inside and outside
the top k, ``-inf`` and NaN log-probs, ``decoded_token`` from token texts with escapes
and multi-byte characters, ``echo`` with ``logprobs``, and batches."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from benchmarks import json_render_reference as reference
from teacher_server.http_api.text import TokenTexts
from teacher_server.http_api.vllm.protocol import PromptLogprobsRequest
from teacher_server.http_api.vllm.serving import (
    prompt_entries,
    render_completions,
    render_token_generate,
)
from topk_protocol import SequenceArrays
from topk_protocol.errors import TeacherError

VOCAB = 4096
_OWN = re.compile(rb'"cmpl-[0-9a-f]+"|"created": \d+')


class _Tokenizer:
    """Token texts with JSON escapes, multi-byte characters, empty and long ones."""

    WORDS = ("a", " the", '"', "\\", "\n", "é", "日本", "", "\u2028", "x" * 40, "\t\x01")

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{self.WORDS[i % len(self.WORDS)]}{i}" for i in ids)


def _scored(rng: np.random.Generator, tokens: np.ndarray, k: int) -> SequenceArrays:
    """Rows for ``tokens`` (K = ``k`` distinct ids each) with the prompt token in the
    top k at about half the positions (at any rank), log-probs with ``-inf`` and NaN."""
    s = len(tokens) - 1
    ids = np.argsort(rng.random((s, VOCAB)), axis=1)[:, :k].astype(np.int32)
    for p in range(s):
        ids[p][ids[p] == tokens[p + 1]] = (tokens[p + 1] + 1) % VOCAB  # outside first
        if rng.random() < 0.5:
            ids[p, rng.integers(0, k)] = tokens[p + 1]
    lps = -np.sort(10.0 ** rng.uniform(-9, 3.5, (s, k)), axis=1).astype(np.float32)
    lps[rng.random((s, k)) < 0.05] = -np.inf
    sampled = -(10.0 ** rng.uniform(-9, 3.5, s)).astype(np.float32)
    sampled[rng.random(s) < 0.1] = -np.inf
    sampled[rng.random(s) < 0.05] = np.nan
    return SequenceArrays(ids, lps, sampled)


def _prompts(rng: np.random.Generator, lengths: list[int], k: int) -> tuple[list, list]:
    tokens = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]
    return tokens, [_scored(rng, t, k) for t in tokens]


def _same(new: bytes, old: bytes) -> None:
    a, b = json.loads(new), json.loads(old)
    for answer in (a, b):
        answer.pop("id", None)
        answer.pop("created", None)
    assert reference.as_float32(a) == reference.as_float32(b)
    assert reference.float_shape(_OWN.sub(b"", new)) == reference.float_shape(_OWN.sub(b"", old))


@pytest.mark.parametrize("s", [0, 1, 3, 47])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_prompt_logprobs_against_the_reference(s: int, k: int) -> None:
    """Token ids, ``prompt_logprobs`` K (and below the engine's K), with and without
    ``decoded_token``; ``/inference/v1/generate`` alike."""
    rng = np.random.default_rng(s * 100 + k)
    (tokens,), (scored,) = _prompts(rng, [s + 1], k)
    texts = TokenTexts(_Tokenizer())
    for prompt_k in sorted({k, max(k // 2, 1)}):
        plain = PromptLogprobsRequest([tokens], [None], prompt_k)
        new = render_completions(plain, [scored], "m", texts)
        _same(new, reference.render_completions(plain, [scored], "m", texts))
        decoded = PromptLogprobsRequest([tokens], [None], prompt_k, echo=True, decoded=True)
        new = render_completions(decoded, [scored], "m", texts)
        _same(new, reference.render_completions(decoded, [scored], "m", texts))
        generate = PromptLogprobsRequest([tokens], [None], prompt_k, request_id="gen-1")
        new = render_token_generate(generate, [scored], "m")
        _same(new, reference.render_token_generate(generate, [scored], "m"))


@pytest.mark.parametrize("logprobs", [0, 1, 4])
def test_a_batch_with_echo_and_logprobs(logprobs: int) -> None:
    """Several prompts (one of a single token), text prompts echoed with ``logprobs``
    N (covering the prompt, keyed by token text), ``prompt_logprobs`` N or none."""
    rng = np.random.default_rng(logprobs)
    tokens, scored = _prompts(rng, [30, 1, 7], 5)
    texts = TokenTexts(_Tokenizer())
    names: list[str | None] = ["a prompt", None, "another"]
    for prompt_k in (None, logprobs, 5):
        request = PromptLogprobsRequest(
            tokens, names, prompt_k, logprobs=logprobs, echo=True, decoded=True
        )
        new = render_completions(request, scored, "m", texts)
        _same(new, reference.render_completions(request, scored, "m", texts))
    no_echo = PromptLogprobsRequest(tokens, [None] * 3, 3, logprobs=logprobs)
    new = render_completions(no_echo, scored, "m", None)
    _same(new, reference.render_completions(no_echo, scored, "m", None))


def test_entries_in_vllms_order() -> None:
    """The prompt token first with its rank (K + 1 outside the top K), then the top k
    by rank without it."""
    tokens = np.array([9, 4, 7], np.int32)
    scored = SequenceArrays(
        np.array([[3, 4, 5], [1, 2, 3]], np.int32),
        np.array([[-0.1, -0.2, -0.3], [-0.5, -1.0, -2.0]], np.float32),
        np.array([-0.2, -6.0], np.float32),
    )
    entries = prompt_entries(tokens, scored, 2)
    kept = [
        [(int(i), int(r)) for i, r, k in zip(ids, ranks, keep, strict=True) if k]
        for ids, ranks, keep in zip(entries.ids, entries.ranks, entries.keep, strict=True)
    ]
    assert kept == [[(4, 2), (3, 1)], [(7, 4), (1, 1), (2, 2)]]
    body = json.loads(
        render_token_generate(PromptLogprobsRequest([tokens], [None], 2), [scored], "m")
    )
    assert body["prompt_logprobs"] == [
        None,
        {"4": {"logprob": -0.2, "rank": 2}, "3": {"logprob": -0.1, "rank": 1}},
        {
            "7": {"logprob": -6.0, "rank": 4},
            "1": {"logprob": -0.5, "rank": 1},
            "2": {"logprob": -1.0, "rank": 2},
        },
    ]


def test_the_engines_rank_outside_the_top_k() -> None:
    """With the backend's ``sampled_ranks``, a prompt token outside the top K gets that
    rank; one inside keeps its place among the K (as in vLLM's answer)."""
    tokens = np.array([9, 4, 7], np.int32)
    scored = SequenceArrays(
        np.array([[3, 4, 5], [1, 2, 3]], np.int32),
        np.array([[-0.1, -0.2, -0.3], [-0.5, -1.0, -2.0]], np.float32),
        np.array([-0.2, -6.0], np.float32),
        sampled_ranks=np.array([3, 117], np.int32),  # the first: a tie counted by the engine
    )
    entries = prompt_entries(tokens, scored, 2)
    assert entries.ranks[:, 0].tolist() == [2, 117]


def test_decoded_tokens_table_grows_and_stays_right() -> None:
    """``decoded_token`` from the table of ids seen so far: ids new to it are added (a
    wider token widening it), the ones already there unchanged."""
    texts = TokenTexts(_Tokenizer())
    for ids in ([5, 1, 5], [300, 9], [1, 9, 4095, 0]):
        cells = texts.json_cells(np.array(ids, np.int32))
        assert cells.tobytes() == b"".join(texts.json(i).encode() for i in ids)


def test_missing_logprobs_are_refused() -> None:
    tokens = np.array([1, 2], np.int32)
    bare = SequenceArrays(np.array([[1]], np.int32), np.array([[-0.5]], np.float32))
    with pytest.raises(TeacherError, match="actual-token log-probs"):
        prompt_entries(tokens, bare, 1)
