"""Padded batches -> unpadded sequences -> payload rows back at their padded columns
(pure functions, no teacher)."""

from __future__ import annotations

import pytest
import torch

from student_client.data.alignment import PaddedLayout, place_rows, prepare_inputs, unpad
from student_client.data.payload import TeacherPayload
from topk_protocol.errors import InvalidRequestError

PAD = 257


def _padded(seqs: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), PAD)
    mask = torch.zeros((len(seqs), t), dtype=torch.int64)
    for b, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ids[b, cols] = torch.tensor(s)
        mask[b, cols] = 1
    return ids, mask


def _fake_payload(seqs: list[list[int]], spans: list[tuple[int, int]], k: int) -> TeacherPayload:
    """A payload whose row for absolute position p of sequence b encodes (b, p)."""
    n = [e - s for s, e in spans]
    rows = max(n)
    ids = torch.zeros(len(seqs), rows, k, dtype=torch.int64)
    mask = torch.zeros(len(seqs), rows, dtype=torch.bool)
    for b, (s, e) in enumerate(spans):
        for j in range(e - s):
            ids[b, j] = 1000 * b + (s + j) + torch.arange(k) * 100_000
            mask[b, j] = True
    lps = torch.where(mask[..., None], -ids.double().div(1e7), 0.0).float()
    return TeacherPayload(
        ids=ids,
        logprobs=lps,
        sampled_logprobs=None,
        mask=mask,
        position_start=torch.tensor([s for s, _ in spans]),
        lengths=torch.tensor(n),
        top_k=k,
        dtype="float32",
    )


SEQS = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_unpad_and_place_rows_round_trip(side: str) -> None:
    ids, mask = _padded(SEQS, side)
    seqs, layout = unpad(ids, mask)
    assert [s.tolist() for s in seqs] == SEQS
    payload = place_rows(_fake_payload(SEQS, [(0, len(s)) for s in SEQS], 2), layout)
    assert payload.ids.shape == (3, 5, 2) and payload.mask.shape == (3, 5)
    assert payload.mask.eq(mask.bool()).all()
    for b in range(3):
        cols = mask[b].nonzero().flatten().tolist()
        for p, col in enumerate(cols):  # absolute position p of sequence b sits at col
            assert payload.ids[b, col, 0].item() == 1000 * b + p
    assert payload.ids[~payload.mask].eq(0).all() and payload.logprobs[~payload.mask].eq(0).all()
    assert payload.lengths.tolist() == [5, 2, 3]


def test_sub_range_payload_placed_into_the_full_layout() -> None:
    """Response-only rows of an unpadded batch land at their absolute positions."""
    spans = [(2, 5), (1, 2), (0, 0)]
    payload = place_rows(_fake_payload(SEQS, spans, 3), PaddedLayout.dense(3, 5))
    assert payload.mask.tolist() == [
        [False, False, True, True, True],
        [False, True, False, False, False],
        [False] * 5,
    ]
    assert payload.ids[0, 2:, 0].tolist() == [2, 3, 4] and payload.ids[1, 1, 0].item() == 1001


def test_positions_are_padded_columns_clipped_to_real_tokens() -> None:
    ids, mask = _padded(SEQS, "left")  # offsets 0, 3, 2
    prep = prepare_inputs({"input_ids": ids, "attention_mask": mask}, positions=[(3, 5)] * 3)
    assert prep.positions == [(3, 5), (0, 2), (1, 3)]
    assert prep.layout is not None and prep.layout.offsets.tolist() == [0, 3, 2]


def test_all_padding_rows_are_not_sent_and_come_back_masked() -> None:
    ids, mask = _padded([[1, 2, 3], [4]], "right")
    mask[1] = 0
    seqs, layout = unpad(ids, mask)
    assert len(seqs) == 1 and layout.rows.tolist() == [0]
    payload = place_rows(_fake_payload([[1, 2, 3]], [(0, 3)], 1), layout)
    assert payload.mask.tolist() == [[True] * 3, [False] * 3]


def test_bad_masks_name_the_field() -> None:
    ids = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(InvalidRequestError, match=r"attention_mask\[1\]: .*contiguous"):
        unpad(ids, torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]))
    with pytest.raises(InvalidRequestError, match="attention_mask: every row is padding"):
        unpad(ids, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(InvalidRequestError, match=r"attention_mask: shape \[2, 3\]"):
        unpad(ids, torch.ones(2, 3))
    with pytest.raises(InvalidRequestError, match="attention_mask: given twice"):
        prepare_inputs({"input_ids": ids, "attention_mask": ids}, attention_mask=ids)
    with pytest.raises(InvalidRequestError, match="needs 'input_ids'"):
        prepare_inputs({"ids": ids})
    with pytest.raises(InvalidRequestError, match="ragged lists; pad it"):
        prepare_inputs({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]})


def test_without_a_mask_inputs_pass_through() -> None:
    ids = torch.ones(2, 3, dtype=torch.int64)
    prep = prepare_inputs({"input_ids": ids})
    assert prep.sequences is ids and prep.layout is None and prep.positions is None


def test_forgetting_the_mask_on_a_padded_payload_suggests_mask() -> None:
    from student_client.losses import TeacherTargets, topk_kl_loss

    ids, mask = _padded(SEQS, "right")
    _, layout = unpad(ids, mask)
    payload = place_rows(_fake_payload(SEQS, [(0, len(s)) for s in SEQS], 2), layout)
    logits = torch.zeros(3, 5, 300_000)
    with pytest.raises(ValueError, match=r"the teacher value needs its mask"):
        topk_kl_loss(logits, TeacherTargets(payload.ids, payload.logprobs))
    loss, _ = topk_kl_loss(logits, TeacherTargets(payload.ids, payload.logprobs, mask=payload.mask))
    assert torch.isfinite(loss)
