"""The payload field table and the one pad/stack/place helper built on it."""

from __future__ import annotations

import math

import numpy as np
import torch

from student_client.data.padding import PayloadBuffers, present_fields
from student_client.data.payload import PAYLOAD_FIELDS, TeacherPayload
from topk_protocol import SequenceArrays
from topk_protocol.arrays import WIRE_FIELDS


def test_table_covers_every_wire_field_with_its_width() -> None:
    table = {f.name: f for f in PAYLOAD_FIELDS}
    for f in WIRE_FIELDS:
        assert f.name in table, f"{f.name}: a SequenceArrays field missing from PAYLOAD_FIELDS"
        assert table[f.name].width == f.width
        assert table[f.name].optional == f.optional
    assert set(table) - {f.name for f in WIRE_FIELDS} == {"mask"}
    assert table["candidate_ids"].pad == -1 and math.isnan(table["candidate_logprobs"].pad)


def test_buffers_hold_pad_values_and_take_rows() -> None:
    out = PayloadBuffers({"candidate_ids", "candidate_logprobs"}, 2, 3, 4, num_candidates=2)
    assert "sampled_logprobs" not in out.tensors
    rows = SequenceArrays(
        np.arange(8).reshape(2, 4),
        -np.ones((2, 4), np.float32),
        candidate_ids=np.array([[5], [6]]),
        candidate_logprobs=np.array([[-0.5], [-0.25]], np.float32),
    )
    out.put((1, slice(0, 2)), {**present_fields(rows), "mask": True})
    p = out.payload(
        position_start=torch.zeros(2, dtype=torch.int64),
        lengths=torch.tensor([0, 2]),
        top_k=4,
        dtype="float32",
    )
    assert isinstance(p, TeacherPayload) and p.sampled_logprobs is None
    assert p.ids.dtype == torch.int64 and p.ids[1, :2].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert p.ids[0].eq(0).all() and p.ids[1, 2].eq(0).all()
    assert p.mask.tolist() == [[False] * 3, [True, True, False]]
    # candidates: the one column given, -1 / NaN everywhere else
    assert p.candidate_ids is not None and p.candidate_logprobs is not None
    assert p.candidate_ids[1, :2].tolist() == [[5, -1], [6, -1]]
    assert p.candidate_ids[0].eq(-1).all()
    assert p.candidate_logprobs[1, 0, 0].item() == -0.5
    assert torch.isnan(p.candidate_logprobs[1, :, 1]).all()


def test_like_holds_what_any_part_has_at_the_widest_candidates() -> None:
    a = SequenceArrays(np.zeros((1, 2)), np.zeros((1, 2)))
    b = SequenceArrays(
        np.zeros((1, 2)),
        np.zeros((1, 2)),
        np.zeros(1),
        candidate_ids=np.zeros((1, 3)),
        candidate_logprobs=np.zeros((1, 3)),
    )
    out = PayloadBuffers.like([a, b], 2, 1, 2)
    assert set(out.tensors) == {
        "ids",
        "logprobs",
        "mask",
        "sampled_logprobs",
        "candidate_ids",
        "candidate_logprobs",
    }
    assert out.tensors["candidate_ids"].shape == (2, 1, 3)
