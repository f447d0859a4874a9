"""Request building and payload decoding, without a server: ragged batches, positions,
row chunks, every dtype, and the checks of the answer against the request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from student_client.data.assembler import ResponseAssembler
from teacher_server.grpc_api.answers import encode_scored, iter_stream_responses
from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    decode_sequence,
    pb,
    request_spans,
)
from topk_protocol.errors import (
    InvalidRequestError,
    TeacherError,
)


def _scored(rng: np.random.Generator, n: int, k: int, start: int, last: bool) -> SequenceArrays:
    """Random rows sorted descending, with a NaN sampled log-prob at the sequence end."""
    ids = np.argsort(rng.random((n, 512)), axis=1)[:, :k].astype(np.int32)
    lps = -np.sort(rng.exponential(2.0, size=(n, k)).astype(np.float32), axis=1)
    sampled = -rng.exponential(3.0, size=n).astype(np.float32)
    if last and n:
        sampled[-1] = np.nan
    return SequenceArrays(ids, lps, sampled, start)


def _case(
    lengths: list[int], spans: list[tuple[int, int]], k: int, seed: int = 0
) -> tuple[list[list[int]], list[SequenceArrays]]:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 512, size=n).tolist() for n in lengths]
    scored = [
        _scored(rng, e - s, k, s, last=e == n) for (s, e), n in zip(spans, lengths, strict=True)
    ]
    return seqs, scored


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """What the wire does to float32 values."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(getattr(torch, dtype)).to(torch.float32).numpy()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 200])
def test_ragged_batch_with_positions_decodes_padded(dtype: str, chunk_bytes: int) -> None:
    lengths = [7, 1, 12, 5]
    spans = [(0, 7), (0, 1), (3, 9), (5, 5)]  # full, 1 token, a sub-range, empty range
    k = 6
    seqs, scored = _case(lengths, spans, k)
    req = build_request(seqs, k, dtype=dtype, positions=spans, request_id="r1")
    enum = req.dtype
    asm = ResponseAssembler(req)
    messages = list(
        iter_stream_responses("r1", scored, RequestOptions(k, enum), chunk_bytes=chunk_bytes)
    )
    if chunk_bytes == 120:
        assert len(messages) >= 5  # the rows really arrive in several chunks
    for msg in messages:
        assert not asm.complete
        asm.add(msg)
    assert asm.complete
    p = asm.payload()
    s_max = max(e - s for s, e in spans)
    assert p.ids.shape == (4, s_max, k) and p.ids.dtype == torch.int64
    assert p.logprobs.shape == (4, s_max, k) and p.logprobs.dtype == torch.float32
    assert p.sampled_logprobs is not None and p.sampled_logprobs.shape == (4, s_max)
    assert p.position_start.tolist() == [s for s, _ in spans]
    assert p.lengths.tolist() == [e - s for s, e in spans]
    assert p.num_positions == sum(e - s for s, e in spans)
    assert p.dtype == dtype and p.top_k == k and p.request_id == "r1"
    for b, sc in enumerate(scored):
        n = len(sc.ids)
        assert p.mask[b].tolist() == [True] * n + [False] * (s_max - n)
        np.testing.assert_array_equal(p.ids[b, :n].numpy(), sc.ids)
        np.testing.assert_array_equal(p.logprobs[b, :n].numpy(), _round(sc.logprobs, dtype))
        np.testing.assert_array_equal(
            p.sampled_logprobs[b, :n].numpy(), _round(sc.sampled_logprobs, dtype)
        )
        # Padding cannot poison a masked loss: finite zeros.
        assert (p.ids[b, n:] == 0).all() and (p.logprobs[b, n:] == 0).all()
        assert (p.sampled_logprobs[b, n:] == 0).all()
    # NaN exactly at the positions that end their sequence (position L-1).
    nan = torch.isnan(p.sampled_logprobs)
    assert nan.nonzero().tolist() == [[0, 6], [1, 0]]


def test_merged_response_equals_the_unary_answer() -> None:
    lengths, spans, k = [9, 4], [(0, 9), (1, 3)], 5
    seqs, scored = _case(lengths, spans, k, seed=3)
    req = build_request(seqs, k, positions=spans, request_id="x")
    asm = ResponseAssembler(req)
    for msg in iter_stream_responses("x", scored, RequestOptions.from_proto(req), chunk_bytes=64):
        asm.add(msg)
    unary = [
        encode_scored(s, RequestOptions.from_proto(req), sequence_index=i)
        for i, s in enumerate(scored)
    ]
    merged = asm.merged_response()
    assert merged.final and merged.request_id == "x"
    assert [m.SerializeToString() for m in merged.sequences] == [
        m.SerializeToString() for m in unary
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_sequences_are_what_the_merged_response_decodes_to(packed: bool) -> None:
    """What the client records (``sequences()``, with the options it built) equals the
    merged one-message answer decoded, without packing the rows again."""
    lengths, spans, k = [9, 4, 3], [(0, 9), (1, 3), (2, 2)], 5
    seqs, scored = _case(lengths, spans, k, seed=4)
    asked = RequestOptions.of(k, encoding="packed" if packed else "default")
    req = build_request(seqs, asked, positions=spans, request_id="x")
    asm = ResponseAssembler(req, asked)
    assert asm.options is asked
    for msg in iter_stream_responses("x", scored, asked, chunk_bytes=64, vocab_size=512):
        asm.add(msg)
    merged = asm.merged_response().sequences
    got = asm.sequences()
    assert got[2] is None  # the empty range
    for i in (0, 1):
        want = decode_sequence(merged[i])
        have = got[i]
        assert have is not None and have.position_start == want.position_start
        np.testing.assert_array_equal(have.ids, want.ids)
        np.testing.assert_array_equal(have.logprobs, want.logprobs)
        np.testing.assert_array_equal(have.sampled_logprobs, want.sampled_logprobs)


def test_without_sampled_logprobs() -> None:
    seqs, scored = _case([4, 2], [(0, 4), (0, 2)], 3)
    req = build_request(seqs, 3, include_sampled=False)
    asm = ResponseAssembler(req)
    asm.add(
        next(iter_stream_responses("", scored, RequestOptions.from_proto(req), chunk_bytes=1 << 20))
    )
    p = asm.payload()
    assert p.sampled_logprobs is None
    assert p.mask.sum().item() == 6


def test_payload_to_device_and_dtype_of_padding() -> None:
    seqs, scored = _case([3], [(0, 3)], 2)
    req = build_request(seqs, 2)
    asm = ResponseAssembler(req)
    asm.add(
        pb.ScoreResponse(
            sequences=[encode_scored(scored[0], RequestOptions.from_proto(req), sequence_index=0)],
            final=True,
        )
    )
    p = asm.payload(device="meta")
    assert p.ids.device.type == "meta" and p.mask.device.type == "meta"


@pytest.mark.parametrize(
    "sequences",
    [
        [[1, 2, 3], [4, 5]],
        [np.array([1, 2, 3], dtype=np.int64), np.array([4, 5], dtype=np.int16)],
        [torch.tensor([1, 2, 3]), torch.tensor([4, 5], dtype=torch.int32)],
        (x for x in [[1, 2, 3], [4, 5]]),
    ],
)
def test_build_request_accepts_ragged_inputs(sequences: object) -> None:
    req = build_request(sequences, 4)
    assert [np.frombuffer(s.token_ids, "<i4").tolist() for s in req.sequences] == [
        [1, 2, 3],
        [4, 5],
    ]
    assert request_spans(req) == [(0, 3), (0, 2)]
    assert not req.sequences[0].HasField("position_start")
    assert not req.HasField("include_sampled_logprobs")


def test_build_request_accepts_2d_tensor_and_array() -> None:
    x = torch.arange(12).reshape(3, 4)
    for batch in (x, x.numpy()):
        req = build_request(batch, 2, dtype="bfloat16", positions=[(0, 4), (1, 2), (4, 4)])
        assert len(req.sequences) == 3 and req.dtype == pb.LOGPROB_DTYPE_BFLOAT16
        assert request_spans(req) == [(0, 4), (1, 2), (4, 4)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sequences": [1, 2, 3]}, "flat list"),
        ({"sequences": []}, "sequences: empty"),
        ({"sequences": [[1], []]}, "sequences[1]: empty"),
        ({"sequences": [[1.5, 2.0]]}, "sequences[0]: token_ids: expected integers"),
        ({"sequences": [[[1, 2]]]}, "sequences[0]: expected a 1-D"),
        ({"sequences": torch.zeros(3, dtype=torch.long)}, "2-D"),
        ({"sequences": "abc"}, "sequences"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"dtype": "float64"}, "dtype"),
        ({"positions": [(0, 2)]}, "positions: 1 (start, end) pairs for 2 sequences"),
        ({"positions": [(0, 2), (1, 9)]}, "positions[1]: [1, 9)"),
        ({"positions": [(0, 2), (2, 1)]}, "positions[1]"),
        ({"positions": [(0, 2), "ab"]}, "positions[1]"),
    ],
)
def test_build_request_rejects_bad_input(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"sequences": [[1, 2, 3], [4, 5]], "top_k": 3}
    args.update(kwargs)
    with pytest.raises(InvalidRequestError) as e:
        build_request(args.pop("sequences"), args.pop("top_k"), **args)  # type: ignore[arg-type]
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def _one_chunk(req: pb.ScoreRequest, scored: list[SequenceArrays]) -> pb.ScoreResponse:
    return next(
        iter_stream_responses(
            req.request_id,
            scored,
            RequestOptions.from_proto(req),
            chunk_bytes=1 << 20,
        )
    )


def test_answer_that_contradicts_the_request_is_refused() -> None:
    seqs, scored = _case([5], [(0, 5)], 4)
    # Wrong K.
    asm = ResponseAssembler(build_request(seqs, 3))
    with pytest.raises(TeacherError, match="top_k 4, requested 3"):
        asm.add(_one_chunk(build_request(seqs, 4), scored))
    # Rows of the wrong positions.
    req = build_request(seqs, 4, positions=[(1, 5)])
    with pytest.raises(TeacherError, match="starts at position 0, expected 1"):
        ResponseAssembler(req).add(_one_chunk(req, scored))
    # Missing rows at the final message.
    short = [s.rows(0, 3) for s in scored]
    req = build_request(seqs, 4)
    with pytest.raises(TeacherError, match="got 3 rows, expected 5"):
        ResponseAssembler(req).add(_one_chunk(req, short))
    # Truncated bytes.
    msg = _one_chunk(req, scored)
    msg.sequences[0].logprobs = msg.sequences[0].logprobs[:-2]
    with pytest.raises(TeacherError, match=r"sequences\[0\]: logprobs: expected 40 bytes"):
        ResponseAssembler(req).add(msg)
    # A sequence index the request does not have.
    msg = _one_chunk(req, scored)
    msg.sequences[0].sequence_index = 3
    with pytest.raises(TeacherError, match="sequence_index 3"):
        ResponseAssembler(req).add(msg)


def test_error_answer_raises_the_typed_exception_on_payload() -> None:
    req = build_request([[1, 2]], 2, request_id="e")
    asm = ResponseAssembler(req)
    asm.add(
        pb.ScoreResponse(
            request_id="e",
            final=True,
            error=pb.Error(code=3, message="sequences[0].token_ids[1]: 9999 is outside"),
        )
    )
    assert asm.complete
    with pytest.raises(InvalidRequestError, match="9999 is outside"):
        asm.payload()
    with pytest.raises(TeacherError):
        asm.merged_response()


def test_payload_twice_gives_equal_tensors_that_share_no_memory() -> None:
    """The first ``payload()`` hands out the buffers the chunks were decoded into as they
    arrived; a second call decodes the kept chunks again, into buffers of its own."""
    seqs, scored = _case([7, 3, 9], [(0, 7), (1, 3), (2, 9)], 5)
    req = build_request(seqs, 5, positions=[(0, 7), (1, 3), (2, 9)])
    asm = ResponseAssembler(req)
    asm.add(_one_chunk(req, scored))
    first, second = asm.payload(), asm.payload()
    for name in ("ids", "logprobs", "sampled_logprobs", "mask"):
        a, b = getattr(first, name), getattr(second, name)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
        assert a.data_ptr() != b.data_ptr(), name
    first.logprobs.zero_()
    assert not torch.equal(first.logprobs, second.logprobs)
