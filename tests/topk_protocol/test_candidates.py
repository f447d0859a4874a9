"""Candidate ids on the wire and in the protocol's rules: building requests (and that a
request without candidates is byte-identical to one built before the field existed),
the checks with their named errors, the codec, ``SequenceArrays`` and the replay rule."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    bytes_per_row,
    decode_sequence,
    encode_sequence,
    encode_token_ids,
    pb,
    response_bytes,
)
from topk_protocol.checks import TeacherLimits, check_candidates
from topk_protocol.errors import InvalidRequestError
from topk_protocol.packing import Packing
from topk_protocol.recording.replay import candidate_logprobs

LIMITS = TeacherLimits(vocab_size=123, max_top_k=64, max_candidates=47)


def _arrays(s: int = 7, k: int = 5, c: int = 3, seed: int = 0) -> SequenceArrays:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 123, (s, k)).astype(np.int32)
    lps = -np.sort(rng.exponential(2.0, (s, k)), axis=1).astype(np.float32)
    cand = rng.integers(-1, 123, (s, c)).astype(np.int32)
    clp = np.where(cand == -1, np.nan, -rng.exponential(3.0, (s, c))).astype(np.float32)
    return SequenceArrays(ids, lps, -rng.exponential(1.0, s).astype(np.float32), 4, cand, clp)


def test_request_without_candidates_is_byte_identical_to_the_old_one() -> None:
    seqs = [np.arange(9), np.arange(4)]
    old = pb.ScoreRequest(request_id="r", top_k=8, dtype=pb.LOGPROB_DTYPE_FLOAT16)
    for s in seqs:
        seq = old.sequences.add(token_ids=encode_token_ids(s))
        seq.position_start, seq.position_end = 1, 3
    for cands in (None, [None, None], [np.zeros((2, 0)), None]):
        new = build_request(seqs, 8, positions=[(1, 3)] * 2, request_id="r", candidate_ids=cands)
        assert new.SerializeToString() == old.SerializeToString()


def test_build_request_candidates_layouts() -> None:
    seqs = [np.arange(9), np.arange(4)]
    batch = torch.arange(2 * 6 * 3).reshape(2, 6, 3) % 100  # [B, S', C], S' >= each S
    req = build_request(seqs, 8, positions=[(2, 8), (1, 4)], candidate_ids=batch)
    a, b = req.sequences
    assert (a.num_candidates, b.num_candidates) == (3, 3)
    assert np.array_equal(np.frombuffer(a.candidate_ids, "<i4"), batch[0].numpy().ravel())
    assert np.array_equal(np.frombuffer(b.candidate_ids, "<i4"), batch[1, :3].numpy().ravel())
    # Each answer row costs C log-probs more (the ids are not echoed).
    per_row = bytes_per_row(8, pb.LOGPROB_DTYPE_FLOAT16, True)
    assert response_bytes(req) == 9 * per_row + 9 * 3 * 2
    with pytest.raises(InvalidRequestError, match=r"candidate_ids\[1\]: 2 rows for the 3"):
        build_request(seqs, 8, positions=[(2, 8), (1, 4)], candidate_ids=[batch[0], batch[1, :2]])
    with pytest.raises(InvalidRequestError, match=r"candidate_ids: 1 rows for 2 sequences"):
        build_request(seqs, 8, candidate_ids=[batch[0]])
    with pytest.raises(InvalidRequestError, match=r"candidate_ids\[0\]: ids must lie in \[-1"):
        build_request(seqs[:1], 8, candidate_ids=[np.full((9, 2), -5)])
    with pytest.raises(InvalidRequestError, match=r"candidate_ids\[0\]: expected integer"):
        build_request(seqs[:1], 8, candidate_ids=[np.zeros((9, 2))])


@pytest.mark.parametrize(
    ("raw", "c", "rows", "words"),
    [
        (np.zeros((3, 48), "<i4").tobytes(), 48, 3, "C = 48 candidates per position exceeds max"),
        (b"\x00" * 10, 2, 3, "10 bytes is not a multiple of 4"),
        (np.zeros((2, 2), "<i4").tobytes(), 2, 3, "4 ids, expected [S, C] = [3, 2] = 6"),
        (np.array([[0, 123]], "<i4").tobytes(), 2, 1, "[0, 1]: 123 is outside [-1, 123)"),
        (np.array([[-2, 0]], "<i4").tobytes(), 2, 1, "[0, 0]: -2 is outside [-1, 123)"),
        (b"\x00" * 8, 0, 1, "8 bytes with num_candidates 0"),
    ],
)  # fmt: skip
def test_check_candidates_names_field_and_limit(raw: bytes, c: int, rows: int, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_candidates(raw, c, rows, LIMITS, "sequences[2].candidate_ids")
    assert err.value.message.startswith("sequences[2].candidate_ids")
    assert words in err.value.message
    if c == 48:
        assert err.value.message.endswith("max_candidates 47")


def test_check_candidates_accepts_and_refuses_without_support() -> None:
    ids = np.array([[-1, 5], [122, 0]], "<i4")
    got = check_candidates(ids.tobytes(), 2, 2, LIMITS, "f")
    assert got is not None and np.array_equal(got, ids)
    assert check_candidates(b"", 0, 5, LIMITS, "f") is None
    none = TeacherLimits(vocab_size=123, max_top_k=64)
    with pytest.raises(InvalidRequestError, match="this teacher scores no candidates"):
        check_candidates(ids.tobytes(), 2, 2, none, "f")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_codec_round_trip(dtype: str) -> None:
    a = _arrays()
    msg = encode_sequence(a, dtype=dtype, sequence_index=3)
    assert msg.num_candidates == 3 and len(msg.candidate_logprobs) == 7 * 3 * (
        4 if dtype == "float32" else 2
    )
    back = decode_sequence(msg, a.candidate_ids)
    assert back.candidate_ids is not None and back.candidate_logprobs is not None
    assert np.array_equal(back.candidate_ids, a.candidate_ids)
    assert np.array_equal(np.isnan(back.candidate_logprobs), a.candidate_ids == -1)
    tol = 0 if dtype == "float32" else 0.02
    np.testing.assert_allclose(back.candidate_logprobs, a.candidate_logprobs, rtol=tol)
    with pytest.raises(ValueError, match="candidate_ids: the payload has candidate log-probs"):
        decode_sequence(msg)
    with pytest.raises(ValueError, match=r"candidate_ids: expected \[7, 3\]"):
        decode_sequence(msg, a.candidate_ids[:, :2])


def test_arrays_carry_candidates_through_rows_top_and_concat() -> None:
    a = _arrays(s=47, k=11, c=5)
    assert a.num_candidates == 5
    cut = a.top(3).rows(10, 20)
    assert cut.ids.shape == (10, 3) and cut.candidate_ids is not None
    assert cut.candidate_ids.shape == (10, 5)  # not cut by top()
    joined = SequenceArrays.concat([a.rows(0, 20), a.rows(20, 47)])
    assert joined.candidate_logprobs is not None
    assert np.array_equal(joined.candidate_logprobs, a.candidate_logprobs, equal_nan=True)
    with pytest.raises(ValueError, match="give both or neither"):
        SequenceArrays(a.ids, a.logprobs, candidate_ids=a.candidate_ids)
    with pytest.raises(ValueError, match=r"candidate_logprobs: expected shape \[S, C\]"):
        SequenceArrays(a.ids, a.logprobs, None, 0, a.candidate_ids, np.zeros((47, 4)))
    with pytest.raises(ValueError, match="num_candidates 2, parts"):
        b = _arrays(s=3, k=11, c=2)
        SequenceArrays.concat([a.rows(0, 3), replace(b, position_start=a.position_start + 3)])


def test_replay_rule_serves_recorded_ids_only() -> None:
    a = _arrays(s=6, k=4, c=5, seed=3)  # positions [4, 10)
    assert a.candidate_ids is not None and a.candidate_logprobs is not None
    asked = a.candidate_ids[1:4, ::-1].copy()  # positions 5..7, columns reversed
    asked[0, 0] = -1
    got = candidate_logprobs(a, 5, 8, asked)
    assert not isinstance(got, str)
    # An id recorded twice at a position answers with its (one) value.
    assert np.array_equal(got[asked != -1], _first_match(a, 5, asked)[asked != -1])
    assert np.array_equal(np.isnan(got), asked == -1)
    missing = asked.copy()
    missing[2, 1] = next(i for i in range(123) if i not in a.candidate_ids[3])
    why = candidate_logprobs(a, 5, 8, missing)
    assert isinstance(why, str) and "positions [7] are not recorded" in why
    plain = SequenceArrays(a.ids, a.logprobs, None, 4)
    assert "recorded without candidate ids" in str(candidate_logprobs(plain, 5, 8, asked))


def _first_match(a: SequenceArrays, start: int, asked: np.ndarray) -> np.ndarray:
    """The recorded value of each asked id at its position (the first column holding it)."""
    assert a.candidate_ids is not None and a.candidate_logprobs is not None
    out = np.full(asked.shape, np.nan, np.float32)
    for r in range(asked.shape[0]):
        row = start - a.position_start + r
        for j, i in enumerate(asked[r]):
            if i != -1:
                col = int(np.flatnonzero(a.candidate_ids[row] == i)[0])
                out[r, j] = a.candidate_logprobs[row, col]
    return out


def test_a_packed_answer_carries_candidate_logprobs_unpacked() -> None:
    """Packing covers the top-k only: candidate log-probs travel in the request's dtype,
    and each row's size counts them in either encoding."""
    arrays = _arrays(s=7, k=5, c=3)
    packing = Packing.of(123, 6)
    msg = encode_sequence(arrays, dtype="float16", packing=packing)
    assert msg.encoding == pb.PAYLOAD_ENCODING_PACKED and not msg.ids and not msg.logprobs
    assert len(msg.candidate_logprobs) == 7 * 3 * 2 and msg.num_candidates == 3
    back = decode_sequence(msg, arrays.candidate_ids)
    assert back.candidate_logprobs is not None and arrays.candidate_logprobs is not None
    want = arrays.candidate_logprobs.astype(np.float16).astype(np.float32)
    assert np.array_equal(back.candidate_logprobs, want, equal_nan=True)
    assert np.array_equal(back.ids, arrays.ids)
    opts = RequestOptions(5, "float16", encoding="packed", logprob_bits=6)
    assert opts.bytes_per_row(123, 3) == opts.bytes_per_row(123) + 3 * 2
    seqs = [np.arange(9)]
    req = build_request(seqs, opts, positions=[(1, 8)], candidate_ids=[arrays.candidate_ids])
    assert response_bytes(req, 123) == 7 * opts.bytes_per_row(123, 3)
