"""Candidate log-probs from the real vLLM teacher (the session's one server, array path,
CPU top-k kernel): equal to the dense transformers log-softmax gathered at the same ids,
and the top-k part of the answer byte for byte what a request without candidates gets."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from dense_reference import dense_logprobs
from engine_drift import FLOAT32_DRIFT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from student_client import TeacherClient
from topk_protocol import build_request, decode_sequence, pb_grpc

pytestmark = pytest.mark.vllm

#: The issue's bound on |vLLM - dense reference| for candidate log-probs (float32).
TOL = 2e-4
VOCAB = 512


@pytest.fixture(scope="module")
def stub(vllm_teacher) -> Iterator[pb_grpc.TeacherStub]:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(vllm_teacher.target) as ch:
        yield pb_grpc.TeacherStub(ch)


@st.composite
def _case(draw: st.DrawFn) -> dict[str, object]:
    """1-3 sequences, each: a length, a sub-range (the whole sequence or not), and
    candidates (or none): C ids per row, from the teacher's likely top (low ids of a
    peaked row are not known in advance, so some rows repeat ids from another row's
    top-k, filled in the test) and from anywhere, with padded entries and padded rows."""
    n = draw(st.integers(1, 3))
    seqs = []
    for _ in range(n):
        length = draw(st.integers(2, 48))
        lo = draw(st.integers(0, length - 1))
        hi = draw(st.sampled_from([length, draw(st.integers(lo, length))]))
        c = draw(st.sampled_from([0, 1, 3, 8, 17]))
        seqs.append(
            {
                "seed": draw(st.integers(0, 2**31 - 1)),
                "length": length,
                "span": (lo, hi),
                "c": c,
                "pad": draw(st.floats(0.0, 0.5)),
                "inside": draw(st.floats(0.0, 1.0)),
            }
        )
    return {"seqs": seqs, "k": draw(st.sampled_from([1, 8, 20]))}


def _candidates(
    rng: np.random.Generator, dense_rows: np.ndarray, c: int, pad: float, inside: float
) -> np.ndarray:
    """``[S, c]`` ids: a share ``inside`` from each row's own top-c (in the teacher's
    top-k), the rest uniform over the vocabulary; a share ``pad`` of entries -1 and the
    last row all -1 when there are several rows."""
    s = dense_rows.shape[0]
    top = np.argsort(-dense_rows, axis=1)[:, :c]
    anywhere = rng.integers(0, VOCAB, size=(s, c))
    ids = np.where(rng.random((s, c)) < inside, top, anywhere)
    ids[rng.random((s, c)) < pad] = -1
    if s > 1:
        ids[-1] = -1
    return ids.astype(np.int32)


@settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_case())
def test_candidate_logprobs_match_dense_reference_and_leave_topk_unchanged(
    stub, reference_backend, case
) -> None:  # type: ignore[no-untyped-def]
    seqs, spans, cands, denses = [], [], [], []
    for spec in case["seqs"]:  # type: ignore[attr-defined]
        rng = np.random.default_rng(spec["seed"])
        seq = rng.integers(0, VOCAB, size=spec["length"]).astype(np.int32)
        lo, hi = spec["span"]
        dense = dense_logprobs(reference_backend, seq)
        seqs.append(seq)
        spans.append((lo, hi))
        denses.append(dense[lo:hi])
        c = spec["c"]
        cands.append(_candidates(rng, dense[lo:hi], c, spec["pad"], spec["inside"]) if c else None)
    k = int(case["k"])  # type: ignore[call-overload]
    plain = build_request(seqs, k, positions=spans, dtype="float32", request_id="plain")
    with_c = build_request(
        seqs, k, positions=spans, dtype="float32", request_id="cand", candidate_ids=cands
    )
    got_plain = stub.Score(plain, timeout=120)
    got = stub.Score(with_c, timeout=120)
    for i, (a, b) in enumerate(zip(got_plain.sequences, got.sequences, strict=True)):
        # The top-k part: byte for byte the answer without candidates.
        assert (a.ids, a.logprobs, a.sampled_logprobs) == (b.ids, b.logprobs, b.sampled_logprobs)
        assert a.num_candidates == 0 and not a.candidate_logprobs
        if cands[i] is None:
            assert b.num_candidates == 0 and not b.candidate_logprobs
            continue
        arrays = decode_sequence(b, cands[i])
        assert arrays.candidate_logprobs is not None
        ids = cands[i]
        pad = ids == -1
        assert np.isnan(arrays.candidate_logprobs[pad]).all()
        want = np.take_along_axis(denses[i], np.where(pad, 0, ids), axis=1)
        diff = np.abs(arrays.candidate_logprobs[~pad] - want[~pad])
        assert diff.size == 0 or float(diff.max()) <= TOL, float(diff.max())
        # Inside the top-k, the candidate value is the top-k entry itself (one tensor).
        for r in range(ids.shape[0]):
            row = dict(zip(arrays.ids[r].tolist(), arrays.logprobs[r].tolist(), strict=True))
            for j in np.flatnonzero(~pad[r]):
                if int(ids[r, j]) in row:
                    assert arrays.candidate_logprobs[r, j] == np.float32(row[int(ids[r, j])])


def test_client_candidates_float16_and_padded_batch(vllm_teacher, reference_backend) -> None:  # type: ignore[no-untyped-def]
    """The blocking client: ``[B, S, C]`` candidates aligned to a left-padded batch, the
    wire in float16, the payload's padding rule (-1 <-> NaN)."""
    rng = np.random.default_rng(7)
    a = rng.integers(0, VOCAB, size=9)
    b = rng.integers(0, VOCAB, size=5)
    input_ids = np.zeros((2, 9), np.int64)
    mask = np.zeros((2, 9), np.int64)
    input_ids[0], mask[0] = a, 1
    input_ids[1, 4:], mask[1, 4:] = b, 1  # left padding
    cands = rng.integers(0, VOCAB, size=(2, 9, 6))
    cands[:, :, 5] = -1
    with TeacherClient(vllm_teacher.target) as client:
        assert client.info().max_candidates >= 6
        payload = client.score(input_ids, 4, attention_mask=mask, candidate_ids=cands)
    assert payload.candidate_ids is not None and payload.candidate_logprobs is not None
    assert payload.candidate_ids.shape == (2, 9, 6)
    real = payload.mask
    assert torch.equal(payload.candidate_ids[real], torch.as_tensor(cands)[real])
    assert (payload.candidate_ids[~real] == -1).all()
    assert torch.equal(payload.candidate_ids == -1, payload.candidate_logprobs.isnan())
    for row, seq, first in ((0, a, 0), (1, b, 4)):
        dense = dense_logprobs(reference_backend, seq.astype(np.int32))
        ids = cands[row, first:, :5]
        want = np.take_along_axis(dense, ids, axis=1).astype(np.float16).astype(np.float32)
        got = payload.candidate_logprobs[row, first:, :5].numpy()
        # float16 rounding: one step of float16 spacing, which grows with the value.
        assert (np.abs(got - want) <= 1e-3 * np.maximum(1.0, np.abs(want))).all()
    assert FLOAT32_DRIFT < TOL
