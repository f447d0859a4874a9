"""Answers: the scored arrays of a request -> one ``Score`` message, or ``ScoreStream``
chunks that cover every row once under the byte budget; both serialized."""

from __future__ import annotations

import numpy as np
import pytest

from teacher_server.grpc_api.answers import encode_response, encode_stream, iter_stream_responses
from teacher_server.validation import Limits, parse_request
from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    bytes_per_row,
    decode_sequence,
    pb,
)


def _scored(n: int, k: int, start: int = 0) -> SequenceArrays:
    ids = np.arange(n * k, dtype=np.int32).reshape(n, k)
    lps = -np.arange(n * k, dtype=np.float32).reshape(n, k) / 10
    return SequenceArrays(ids, lps, -np.arange(n, dtype=np.float32), start)


@pytest.mark.parametrize("chunk_rows", [1, 7, 10, 1000])
def test_stream_chunks_cover_every_row_once_under_budget(chunk_rows: int) -> None:
    k, dtype = 4, pb.LOGPROB_DTYPE_FLOAT32
    seqs = [_scored(23, k, 3), _scored(0, k, 5), _scored(1, k), _scored(10, k)]
    per_row = bytes_per_row(k, dtype, True)
    msgs = list(
        iter_stream_responses("r", seqs, RequestOptions(k, dtype), chunk_bytes=chunk_rows * per_row)
    )
    assert [m.final for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert all(m.request_id == "r" for m in msgs)
    pieces: dict[int, list] = {i: [] for i in range(len(seqs))}
    for m in msgs:
        assert sum(p.num_positions for p in m.sequences) <= chunk_rows
        for p in m.sequences:
            pieces[p.sequence_index].append(decode_sequence(p))
    for i, seq in enumerate(seqs):
        whole = SequenceArrays.concat(pieces[i])
        np.testing.assert_array_equal(whole.ids, seq.ids)
        np.testing.assert_array_equal(whole.logprobs, seq.logprobs)
        assert whole.position_start == seq.position_start
        starts = [c.position_start for c in pieces[i]]
        assert starts == sorted(starts)
    total_rows = sum(len(s.ids) for s in seqs)
    assert len(msgs) == max(1, -(-total_rows // chunk_rows))


def test_score_and_stream_answers_carry_the_same_rows() -> None:
    k = 3
    req = build_request([[1, 2, 3, 4], [5, 6]], k, positions=[(1, 4), (0, 0)], request_id="q")
    parsed = parse_request(req, Limits(vocab_size=16))
    scored = [_scored(3, k, 1), _scored(0, k, 0)]
    one = pb.ScoreResponse.FromString(encode_response(parsed, scored, 0.5))
    assert one.request_id == "q" and one.final and one.teacher_seconds == 0.5
    chunks = encode_stream(parsed, scored, 0.5, chunk_bytes=bytes_per_row(k, req.dtype, True))
    assert [c.final for c in chunks] == [False, False, True]
    streamed = [pb.ScoreResponse.FromString(c.message) for c in chunks]
    assert streamed[-1].teacher_seconds == 0.5
    for i, seq in enumerate(scored):
        whole = decode_sequence(one.sequences[i])
        parts = [decode_sequence(p) for m in streamed for p in m.sequences if p.sequence_index == i]
        np.testing.assert_array_equal(SequenceArrays.concat(parts).ids, whole.ids)
        np.testing.assert_array_equal(whole.ids, seq.ids)
        assert whole.position_start == seq.position_start
