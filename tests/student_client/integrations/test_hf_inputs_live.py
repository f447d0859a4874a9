"""Tokenizer batches against the session's vLLM teacher: a right- or left-padded batch
gives, position by position, the payload of each unpadded sequence scored alone; padding
rows are masked; a ``BatchEncoding`` works in ``score`` and ``stream``; a response-only
sub-range lands at its columns of the full layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ServerProcess

from student_client.clients.blocking import TeacherClient
from student_client.data.alignment import PaddedLayout, place_rows
from student_client.data.batch import ScoreBatch
from student_client.data.payload import TeacherPayload

pytestmark = pytest.mark.vllm

K = 8
TEXTS = ["def f(x):\n    return x + 1\n", "import os", "class A:\n    pass"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _assert_aligned(padded: TeacherPayload, mask: torch.Tensor, alone: list[TeacherPayload]):  # type: ignore[no-untyped-def]
    """Real columns of row b hold sequence b's rows in order; the rest is masked padding."""
    assert padded.mask.tolist() == mask.bool().tolist()
    assert padded.ids.shape[:2] == mask.shape
    for b, one in enumerate(alone):
        cols = mask[b].bool()
        assert torch.equal(padded.ids[b, cols], one.ids[0])
        assert torch.equal(padded.logprobs[b, cols], one.logprobs[0])
        assert padded.sampled_logprobs is not None and one.sampled_logprobs is not None
        torch.testing.assert_close(
            padded.sampled_logprobs[b, cols],
            one.sampled_logprobs[0],
            rtol=0,
            atol=0,
            equal_nan=True,
        )
        assert padded.ids[b, ~cols].eq(0).all() and padded.logprobs[b, ~cols].eq(0).all()


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_match_each_sequence_scored_alone(
    vllm_teacher: ServerProcess,
    tokenizer,
    side: str,  # type: ignore[no-untyped-def]
) -> None:
    tokenizer.padding_side = side
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    assert not mask.all(), "the texts must differ in length"
    edge = mask[:, -1] if side == "right" else mask[:, 0]
    assert not edge.all(), f"expected {side} padding"
    with TeacherClient(vllm_teacher.target) as client:
        alone = [client.score([tokenizer(t)["input_ids"]], K, dtype="float32") for t in TEXTS]
        by_args = client.score(enc["input_ids"], K, dtype="float32", attention_mask=mask)
        by_encoding = client.score(enc, K, dtype="float32")
        streamed = list(
            client.stream(
                [enc, ScoreBatch(enc["input_ids"], attention_mask=mask)], K, dtype="float32"
            )
        )
    for payload in (by_args, by_encoding, *streamed):
        _assert_aligned(payload, mask, alone)


def test_response_sub_range_placed_into_the_full_layout(
    vllm_teacher: ServerProcess,
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    """Positions given as padded columns (left padding): only those rows are scored and
    they come back where a full-batch score puts them."""
    tokenizer.padding_side = "left"
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    t = enc["input_ids"].shape[1]
    cols = [(t - 4, t)] * len(TEXTS)
    with TeacherClient(vllm_teacher.target) as client:
        full = client.score(enc, K, dtype="float32")
        part = client.score(enc, K, dtype="float32", positions=cols)
        # The same rows for unpadded sequences, placed with the dense layout.
        seqs = [tokenizer(x)["input_ids"] for x in TEXTS]
        spans = [(len(s) - 4, len(s)) for s in seqs]
        raw = client.score(seqs, K, dtype="float32", positions=spans)
    assert part.mask[:, : t - 4].eq(False).all() and part.mask[:, t - 4 :].all()
    assert torch.equal(part.ids[:, t - 4 :], full.ids[:, t - 4 :])
    assert torch.equal(part.logprobs[:, t - 4 :], full.logprobs[:, t - 4 :])
    longest = max(map(len, seqs))
    dense = place_rows(raw, PaddedLayout.dense(len(seqs), longest))
    for b, s in enumerate(seqs):
        assert torch.equal(dense.ids[b, len(s) - 4 : len(s)], part.ids[b, t - 4 :])
        assert dense.mask[b].sum() == 4
