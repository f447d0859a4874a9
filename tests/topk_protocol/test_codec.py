"""Round trips of the wire codec for every dtype and edge shapes (no server)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from topk_protocol import (
    SequenceArrays,
    decode_floats_into,
    decode_sequence,
    decode_sequence_into,
    decode_token_ids,
    dtype_from_name,
    encode_sequence,
    encode_token_ids,
    pb,
)
from topk_protocol.packing import Packing

SHAPES = [(0, 4), (1, 1), (1, 64), (47, 1), (47, 8), (3, 256), (129, 64)]
DTYPES = ["float32", "float16", "bfloat16"]


def _arrays(s: int, k: int, seed: int = 0, position_start: int = 0) -> SequenceArrays:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, size=(s, k), dtype=np.int64)
    lp = -np.sort(rng.exponential(3.0, size=(s, k)), axis=1).astype(np.float32)
    sampled = -rng.exponential(3.0, size=s).astype(np.float32)
    if s:
        sampled[-1] = np.nan
    return SequenceArrays(ids, lp, sampled, position_start)


def _expected(x: np.ndarray, dtype: str) -> np.ndarray:
    t = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype))
    return t.float().numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_numpy(shape: tuple[int, int], dtype: str) -> None:
    a = _arrays(*shape, position_start=5)
    msg = encode_sequence(a, dtype=dtype, sequence_index=2)
    wire = pb.SequencePayload.FromString(msg.SerializeToString())
    out = decode_sequence(wire)
    assert out.ids.shape == shape and out.ids.dtype == np.int32
    np.testing.assert_array_equal(out.ids, a.ids)
    # Same rounding as torch's own conversion (bfloat16: round-to-nearest-even).
    np.testing.assert_array_equal(out.logprobs, _expected(a.logprobs, dtype))
    assert out.sampled_logprobs is not None and a.sampled_logprobs is not None
    np.testing.assert_array_equal(out.sampled_logprobs, _expected(a.sampled_logprobs, dtype))
    assert (out.position_start, wire.sequence_index) == (5, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_floats_into_a_strided_view(shape: tuple[int, int], dtype: str) -> None:
    """The one decoder writes into a slice of a larger array (what the assembler does)."""
    a = _arrays(*shape, seed=1)
    msg = encode_sequence(a, dtype=dtype)
    big = np.full((2, shape[0] + 3, shape[1]), 7.0, np.float32)
    decode_floats_into(big[1, 2 : 2 + shape[0]], msg.logprobs, dtype_from_name(dtype), "lp")
    np.testing.assert_array_equal(big[1, 2 : 2 + shape[0]], _expected(a.logprobs, dtype))
    assert (
        (big[0] == 7.0).all()
        and (big[1, :2] == 7.0).all()
        and (big[1, 2 + shape[0] :] == 7.0).all()
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sequence_into_equals_decode_sequence(dtype: str, packed: bool) -> None:
    """Decoding into slices of a padded batch gives what ``decode_sequence`` gives."""
    a = replace(
        _arrays(5, 4, seed=2),
        sample_counts=np.arange(20).reshape(5, 4) % 3,
        proposal_log_normalizer=np.linspace(-1, 1, 5),
    )
    msg = encode_sequence(a, dtype=dtype, packing=Packing(18, 8) if packed else None)
    want = decode_sequence(msg)
    out = {
        "ids": np.zeros((2, 7, 4), np.int64),
        "logprobs": np.zeros((2, 7, 4), np.float32),
        "sampled_logprobs": np.zeros((2, 7), np.float32),
        "sample_counts": np.zeros((2, 7, 4), np.int64),
        "proposal_log_normalizer": np.zeros((2, 7), np.float32),
        "mask": np.zeros((2, 7), bool),  # not a wire field: left alone
    }
    decode_sequence_into({k: v[1, 1:6] for k, v in out.items()}, msg)
    for name in ("ids", "logprobs", "sampled_logprobs", "sample_counts"):
        np.testing.assert_array_equal(out[name][1, 1:6], getattr(want, name))
        assert not out[name][0].any() and not out[name][1, 6:].any()
    np.testing.assert_array_equal(
        out["proposal_log_normalizer"][1, 1:6], want.proposal_log_normalizer
    )
    assert not out["mask"].any()


def test_payload_size_at_k64_float16() -> None:
    msg = encode_sequence(_arrays(100, 64), dtype="float16")
    per_position = len(msg.SerializeToString()) / 100
    assert 386 <= per_position <= 390  # 64 x (4 + 2) + 2 plus a few bytes of framing


def test_bfloat16_rounding_and_nan() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -0.0, np.inf, -np.inf, np.nan], np.float32)
    msg = encode_sequence(SequenceArrays(np.zeros((1, 7), np.int32), x[None]), dtype="bfloat16")
    got = decode_sequence(msg).logprobs[0]
    want = torch.from_numpy(x).bfloat16().float().numpy()
    np.testing.assert_array_equal(got[:-1], want[:-1])
    assert np.isnan(got[-1])


def test_sampled_omitted() -> None:
    a = _arrays(4, 2)
    msg = encode_sequence(SequenceArrays(a.ids, a.logprobs), dtype="float32")
    assert decode_sequence(msg).sampled_logprobs is None


def test_token_ids_round_trip() -> None:
    x = np.array([0, 1, 2**31 - 1, 255], np.int64)
    np.testing.assert_array_equal(decode_token_ids(encode_token_ids(x)), x)
    with pytest.raises(ValueError, match="token_ids"):
        encode_token_ids(np.array([2**31]))
    with pytest.raises(ValueError, match="token_ids"):
        encode_token_ids(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="token_ids"):
        decode_token_ids(b"abc")


def test_bad_messages_name_the_field() -> None:
    a = _arrays(3, 4)
    msg = encode_sequence(a, dtype="float16")
    msg.num_positions = 4
    with pytest.raises(ValueError, match="ids"):
        decode_sequence(msg)
    msg = encode_sequence(a, dtype="float16")
    msg.logprobs = msg.logprobs[:-2]
    with pytest.raises(ValueError, match="logprobs"):
        decode_sequence(msg)
    with pytest.raises(ValueError, match="logprobs"):
        decode_floats_into(np.zeros((3, 4), np.float32), msg.logprobs, msg.dtype, "logprobs")
    with pytest.raises(ValueError, match="dtype"):
        dtype_from_name("float64")
    with pytest.raises(ValueError, match="dtype"):
        dtype_from_name(9)
    assert dtype_from_name(pb.LOGPROB_DTYPE_DEFAULT) == pb.LOGPROB_DTYPE_FLOAT16


def test_streamed_chunks_concat_to_the_whole() -> None:
    whole = _arrays(47, 8)
    parts = [
        decode_sequence(encode_sequence(whole.rows(a, b), dtype="float32"))
        for a, b in [(0, 1), (1, 20), (20, 47)]
    ]
    joined = SequenceArrays.concat(parts)
    np.testing.assert_array_equal(joined.ids, whole.ids)
    np.testing.assert_array_equal(joined.logprobs, whole.logprobs)
    assert joined.sampled_logprobs is not None
    np.testing.assert_array_equal(joined.sampled_logprobs, whole.sampled_logprobs)
