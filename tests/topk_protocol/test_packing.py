"""The packed encoding: bit packing, the per-row log-prob grid and its error bound, the
packed wire payload (ids exact, log-probs within the bound, idempotent), its sizes, and
the request options that ask for it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    bytes_per_row,
    decode_sequence,
    encode_sequence,
    pb,
)
from topk_protocol.checks import MAX_LOGPROB_BITS, MIN_LOGPROB_BITS, check_encoding
from topk_protocol.errors import InvalidRequestError
from topk_protocol.packing import (
    DEFAULT_LOGPROB_BITS,
    Packing,
    error_bound,
    id_bits,
    pack_uint,
    packed_bytes_per_position,
    packed_payload_bytes,
    packed_roundtrip,
    uint_bytes,
    unpack_uint,
)

DTYPES = ("float32", "float16", "bfloat16")


def _rows(seed: int, s: int, k: int, scale: float) -> np.ndarray:
    """``[S, K]`` sorted-descending log-probs: a log-softmax's top K of a random row."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, scale, (s, max(k, 2) * 4)).astype(np.float32)
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -np.sort(-lp, axis=1)[:, :k].astype(np.float32)


def _arrays(seed: int, s: int, k: int, vocab: int, scale: float) -> SequenceArrays:
    rng = np.random.default_rng(seed + 1)
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(s)]) if s else None
    ids = np.zeros((0, k), np.int32) if ids is None else ids
    sampled = rng.normal(-3, 1, s).astype(np.float32)
    return SequenceArrays(ids, _rows(seed, s, k, scale), sampled, position_start=seed % 7)


@given(bits=st.integers(1, 32), n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_pack_uint_roundtrip(bits: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**bits, n, dtype=np.uint64).astype(np.uint32)
    buf = pack_uint(values, bits)
    assert len(buf) == uint_bytes(n, bits)
    np.testing.assert_array_equal(unpack_uint(buf, bits, n), values)


def test_unpack_uint_refuses_a_wrong_length() -> None:
    with pytest.raises(ValueError, match="expected 24 bytes for 10 values of 18 bits"):
        unpack_uint(b"\0" * 22, 18, 10)


@pytest.mark.parametrize(("vocab", "bits"), [(1, 1), (2, 1), (3, 2), (512, 9), (151_936, 18)])
def test_id_bits(vocab: int, bits: int) -> None:
    assert id_bits(vocab) == bits


@settings(max_examples=examples(150), deadline=None)
@given(
    vocab=st.integers(2, 300_000),
    k=st.integers(1, 70),
    s=st.integers(0, 40),
    bits=st.integers(MIN_LOGPROB_BITS, MAX_LOGPROB_BITS),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.01, 1.0, 4.0, 12.0]),
    seed=st.integers(0, 2**16),
)
def test_packed_payload_decodes_within_the_bound(
    vocab: int, k: int, s: int, bits: int, dtype: str, scale: float, seed: int
) -> None:
    """decode(encode(x)): ids exact, every log-prob within error_bound of float32, the
    sampled log-probs as the unpacked dtype payload carries them, the byte count the
    formula's, and packing the decoded rows again gives the same bytes."""
    k = min(k, vocab)
    arrays = _arrays(seed, s, k, vocab, scale)
    packing = Packing.of(vocab, bits)
    msg = encode_sequence(arrays, dtype=dtype, sequence_index=3, packing=packing)
    got = decode_sequence(msg)
    np.testing.assert_array_equal(got.ids, arrays.ids)
    assert got.position_start == arrays.position_start
    error = np.abs(got.logprobs - arrays.logprobs)
    if s:
        assert (error <= error_bound(arrays.logprobs, bits, dtype)[:, None]).all()
    plain = decode_sequence(encode_sequence(arrays, dtype=dtype))
    assert got.sampled_logprobs is not None and plain.sampled_logprobs is not None
    np.testing.assert_array_equal(got.sampled_logprobs, plain.sampled_logprobs)
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    assert len(msg.packed_ids) + len(msg.packed_logprobs) + len(
        msg.sampled_logprobs
    ) == packed_payload_bytes(s, k, vocab, bits, size)
    assert not msg.ids and not msg.logprobs
    again = encode_sequence(got, dtype=dtype, sequence_index=3, packing=packing)
    assert again.SerializeToString() == msg.SerializeToString()


@settings(max_examples=examples(40), deadline=None)
@given(
    k=st.integers(1, 40),
    bits=st.integers(MIN_LOGPROB_BITS, MAX_LOGPROB_BITS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_function_is_what_the_wire_decodes_to(
    k: int, bits: int, dtype: str, seed: int
) -> None:
    """``packed_roundtrip`` (the quality benchmark's) equals encoding and decoding, on any
    leading shape, numpy or torch."""
    import torch

    x = _rows(seed, 3 * 5, k, 3.0)
    msg = encode_sequence(
        SequenceArrays(np.zeros((15, k), np.int32), x), dtype=dtype, packing=Packing(1, bits)
    )
    wire = decode_sequence(msg).logprobs
    np.testing.assert_array_equal(
        packed_roundtrip(x.reshape(3, 5, k), bits, dtype), wire.reshape(3, 5, k)
    )
    t = packed_roundtrip(torch.from_numpy(x), bits, dtype)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), wire)


def test_error_bound_is_half_a_step_on_a_wide_row() -> None:
    """At 8 bits a row spanning 25.5 nats has steps of 0.1: the bound is 0.05 (plus the
    float32 slack), and the first and last value are the dtype's."""
    row = np.linspace(0.0, -25.5, 64, dtype=np.float32)[None]
    bound = error_bound(row, 8, "float32")
    assert 0.05 <= bound[0] < 0.05 + 1e-4
    out = packed_roundtrip(row, 8, "float32")
    assert out[0, 0] == row[0, 0] and out[0, -1] == row[0, -1]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_log_probs_are_refused(bad: float) -> None:
    row = np.array([[-0.1, -1.0, bad, -9.0]], np.float32)
    with pytest.raises(ValueError, match="logprobs: the packed encoding needs finite"):
        packed_roundtrip(row, 8)


def test_unsorted_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted descending"):
        packed_roundtrip(np.array([[-1.0, -0.5]], np.float32), 8)


def test_ids_outside_the_id_width_are_refused() -> None:
    arrays = SequenceArrays(np.array([[600]]), np.array([[-0.1]], np.float32))
    with pytest.raises(ValueError, match=r"ids: outside \[0, 2\*\*9\)"):
        encode_sequence(arrays, packing=Packing.of(512))


def test_bytes_at_k64_v151936() -> None:
    """The goal's case: 212 bytes per position at the default 8 bits and float16,
    <= 0.55x of the default payload's 386."""
    default = bytes_per_row(64, pb.LOGPROB_DTYPE_FLOAT16, True)
    assert default == 386
    packed = packed_bytes_per_position(64, 151_936, DEFAULT_LOGPROB_BITS)
    assert packed == 212.0
    assert packed <= 0.55 * default
    assert packed_payload_bytes(1000, 64, 151_936) == 212_000
    opts = RequestOptions(64, encoding="packed")
    assert opts.bytes_per_row(151_936) == 212  # what chunking and the one-message rule count
    assert opts.bytes_per_row() > 212  # vocabulary unknown: an upper bound (32-bit ids)


def test_packed_options_round_trip_through_the_request() -> None:
    opts = RequestOptions(8, encoding="packed", logprob_bits=5)
    req = build_request([[1, 2, 3]], opts)
    assert req.encoding == pb.PAYLOAD_ENCODING_PACKED and req.logprob_bits == 5
    assert RequestOptions.from_proto(req) == opts
    default = RequestOptions(8, encoding="packed")
    assert default.logprob_bits == DEFAULT_LOGPROB_BITS


def test_default_requests_are_byte_identical() -> None:
    """A request that does not ask for packing carries none of its fields."""
    req = build_request([[1, 2, 3]], 4)
    want = pb.ScoreRequest(top_k=4, dtype=pb.LOGPROB_DTYPE_FLOAT16)  # type: ignore[arg-type]
    want.sequences.add(token_ids=np.array([1, 2, 3], "<i4").tobytes())
    assert req.SerializeToString() == want.SerializeToString()
    arrays = _arrays(0, 3, 4, 512, 1.0)
    msg = encode_sequence(arrays)
    assert not msg.packed_ids and not msg.packed_logprobs and msg.encoding == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"encoding": "packed", "logprob_bits": 0}, r"logprob_bits: 0 is outside \[1, 16\]"),
        ({"encoding": "packed", "logprob_bits": 17}, r"logprob_bits: 17 is outside \[1, 16\]"),
        ({"encoding": "packed", "logprob_bits": 2.5}, "logprob_bits: expected an int"),
        ({"logprob_bits": 8}, "logprob_bits: 8 asked with encoding 'default'"),
        ({"encoding": "zip"}, "encoding: 'zip' is not one of default, packed"),
    ],
)
def test_bad_packed_options_name_the_field_and_limit(options: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        RequestOptions(4, **options)


def test_bad_packed_fields_of_a_received_request() -> None:
    req = build_request([[1, 2]], 4)
    req.encoding = 7  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="encoding: unknown payload encoding 7"):
        RequestOptions.from_proto(req)
    req = build_request([[1, 2]], 4, encoding="packed")
    req.logprob_bits = 40
    with pytest.raises(InvalidRequestError, match=r"logprob_bits: 40 is outside \[1, 16\]"):
        RequestOptions.from_proto(req)


def test_an_encoding_the_teacher_lacks_is_refused_naming_what_it_serves() -> None:
    check_encoding("packed", ("default", "packed"))
    with pytest.raises(
        InvalidRequestError,
        match="encoding: 'packed' is not served by this teacher; it serves default",
    ):
        check_encoding("packed", ("default",))
