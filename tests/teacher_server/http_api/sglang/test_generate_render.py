"""SGLang's ``/generate`` answer as the vectorized renderer writes it, against the
per-entry reference (:mod:`benchmarks.json_render_reference`), without an engine: the
same JSON once every float is read as float32, and the same bytes apart from how the
floats are written, on odd shapes (S in {0, 1, 3, 47}, K in {1, 5, 64}), ``-inf`` and
NaN log-probs, a ``logprob_start_len``, shared and per-position ``token_ids_logprob``
lists with -1 padding, no log-probs, batches, and ``return_text_in_logprobs`` (each
entry's text from the token-text table, against the reference's per-entry decode)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import json_render_reference as reference
from teacher_server.http_api.sglang.protocol import GenerateItem, GenerateRequest
from teacher_server.http_api.sglang.serving import render_generate
from teacher_server.http_api.text import TokenTexts
from topk_protocol import SequenceArrays
from topk_protocol.errors import TeacherError

VOCAB = 151_936


def _logprobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Log-probs with some ``-inf`` and NaN, tiny and large magnitudes."""
    lps = -(10.0 ** rng.uniform(-9, 3.5, shape)).astype(np.float32)
    lps[rng.random(shape) < 0.05] = -np.inf
    lps[rng.random(shape) < 0.02] = np.nan
    lps[rng.random(shape) < 0.02] = 0.0
    return lps


def _item(
    rng: np.random.Generator, length: int, start: int, top: int, candidates: str, rid: str
) -> tuple[GenerateItem, SequenceArrays]:
    """An item of ``length`` tokens from ``start`` and its scored rows (K = ``top``)."""
    tokens = rng.integers(0, VOCAB, length).astype(np.int32)
    cand: np.ndarray | None = None
    entries = length - start
    if candidates == "shared":
        cand = rng.integers(0, VOCAB, 4).astype(np.int32)
    elif candidates == "per-position":
        cand = rng.integers(0, VOCAB, (entries, 4)).astype(np.int32)
        widths = rng.integers(0, 5, entries)
        cand[np.arange(4)[None, :] >= widths[:, None]] = -1
    item = GenerateItem(tokens, True, start, top, cand, rid)
    a, b = item.rows
    s, k = b - a, max(top, 1)
    rows = item.candidate_rows()
    extra = {}
    if rows is not None:
        clps = _logprobs(rng, rows.shape)
        clps[rows == -1] = np.nan
        extra = {"candidate_ids": rows, "candidate_logprobs": clps}
    scored = SequenceArrays(
        rng.integers(0, VOCAB, (s, k)).astype(np.int32),
        _logprobs(rng, (s, k)),
        _logprobs(rng, (s,)),
        position_start=a,
        **extra,
    )
    return item, scored


class _Tokenizer:
    """Token texts with JSON escapes, multi-byte characters, empty and long ones."""

    WORDS = ("a", " the", '"', "\\", "\n", "é", "日本", "", "\u2028", "x" * 40, "\t\x01")

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{self.WORDS[i % len(self.WORDS)]}{i % 97}" for i in ids)


def _check(
    request: GenerateRequest, scored: list[SequenceArrays], texts: TokenTexts | None = None
) -> None:
    new = render_generate(request, scored, 0.125, texts)
    old = reference.render_generate(request, scored, 0.125, texts)
    assert reference.as_float32(json.loads(new)) == reference.as_float32(json.loads(old))
    assert reference.float_shape(new) == reference.float_shape(old)


@pytest.mark.parametrize("s", [0, 1, 3, 47])
@pytest.mark.parametrize("k", [1, 5, 64])
@pytest.mark.parametrize("candidates", ["none", "shared", "per-position"])
def test_one_item_against_the_reference(s: int, k: int, candidates: str) -> None:
    rng = np.random.default_rng(s * 1000 + k)
    item, scored = _item(rng, s + 1, 0, k, candidates, f"rid-{s}")
    _check(GenerateRequest([item], batched=False), [scored])


@pytest.mark.parametrize("top", [0, 3])
def test_a_start_a_batch_and_no_logprobs(top: int) -> None:
    """A batch: items from a ``logprob_start_len``, from the end (no entries), one
    token, and one without ``return_logprob``."""
    rng = np.random.default_rng(top)
    items, scored = [], []
    for i, (length, start, candidates) in enumerate(
        [(50, 7, "per-position"), (9, 9, "shared"), (1, 0, "none"), (12, 0, "shared")]
    ):
        item, rows = _item(rng, length, start, top, candidates, f"r{i}")
        items.append(item)
        scored.append(rows)
    plain = GenerateItem(rng.integers(0, VOCAB, 5).astype(np.int32), False, 5, 0, None, "off")
    items.append(plain)
    scored.append(SequenceArrays(np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32)))
    _check(GenerateRequest(items, batched=True), scored)
    _check(GenerateRequest(items[:1], batched=True), scored[:1])


@pytest.mark.parametrize("candidates", ["none", "shared", "per-position"])
def test_text_in_logprobs_writes_each_entrys_text(candidates: str) -> None:
    """``return_text_in_logprobs``: ``[lp, id, text]`` in every input field, position 0
    included, the text ``tokenizer.decode([id])``; without it the same answer with null."""
    rng = np.random.default_rng(7)
    texts = TokenTexts(_Tokenizer())
    item, scored = _item(rng, 30, 3, 5, candidates, "t")
    with_text = GenerateRequest([item, item], batched=True, text_in_logprobs=True)
    _check(with_text, [scored, scored], texts)
    answer = json.loads(render_generate(with_text, [scored, scored], 0.0, texts))[0]["meta_info"]
    first, *rest = answer["input_token_logprobs"]
    assert first == [None, int(item.token_ids[3]), _Tokenizer().decode([int(item.token_ids[3])])]
    for entry in rest + [e for row in answer["input_top_logprobs"][1:] for e in row]:
        assert entry[2] == _Tokenizer().decode([entry[1]])
    plain = GenerateRequest([item], batched=False)
    nulls = json.loads(render_generate(plain, [scored], 0.0, texts))["meta_info"]
    assert all(e[2] is None for e in nulls["input_token_logprobs"])
    with pytest.raises(TeacherError, match="needs the backend's tokenizer"):
        render_generate(with_text, [scored, scored], 0.0, None)


def test_missing_logprobs_are_refused() -> None:
    rng = np.random.default_rng(0)
    item, scored = _item(rng, 4, 0, 2, "shared", "r")
    bare = SequenceArrays(scored.ids, scored.logprobs, scored.sampled_logprobs)
    with pytest.raises(TeacherError, match="candidate log-probs"):
        render_generate(GenerateRequest([item], False), [bare], 0.0)
    no_actual = SequenceArrays(scored.ids, scored.logprobs)
    with pytest.raises(TeacherError, match="actual-token log-probs"):
        render_generate(GenerateRequest([item], False), [no_actual], 0.0)
