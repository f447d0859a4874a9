"""Arrays <-> wire messages, with no per-element Python loop.

Both sides use this module: the teacher encodes a
:class:`~topk_protocol.arrays.SequenceArrays` into a ``SequencePayload`` message; the
student decodes it back (:func:`decode_floats_into` is the one log-prob decoder, used by
:func:`decode_sequence` and by the client's response assembler).
All arrays on the wire are little-endian and row-major (layout: ``docs/protocol.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.arrays import WIRE_FIELDS, SequenceArrays
from topk_protocol.floats import f32_to_bf16_bits
from topk_protocol.packing import (
    ENDS_PER_ROW,
    Packing,
    dequantize_logprobs,
    pack_uint,
    quantize_logprobs,
    uint_bytes,
    unpack_uint,
)

__all__ = [
    "DTYPE_NAMES",
    "ENCODING_NAMES",
    "SCHEMA_VERSION",
    "decode_floats_into",
    "decode_packed_into",
    "decode_sequence",
    "decode_sequence_into",
    "decode_token_ids",
    "dtype_from_name",
    "dtype_name",
    "encode_sequence",
    "encode_token_ids",
    "itemsize",
]

#: The schema version this code speaks (``TeacherInfo.schema_version``).
SCHEMA_VERSION = pb.SCHEMA_VERSION_1

DTYPE_NAMES: dict[str, int] = {
    "float32": pb.LOGPROB_DTYPE_FLOAT32,
    "float16": pb.LOGPROB_DTYPE_FLOAT16,
    "bfloat16": pb.LOGPROB_DTYPE_BFLOAT16,
}
_ENUM_TO_NAME: dict[int, str] = {v: k for k, v in DTYPE_NAMES.items()}
#: Payload encodings by name (``PayloadEncoding``; docs/protocol.md, "Packed payloads").
ENCODING_NAMES: dict[str, int] = {
    "default": pb.PAYLOAD_ENCODING_DEFAULT,
    "packed": pb.PAYLOAD_ENCODING_PACKED,
}
_ITEMSIZE: dict[int, int] = {
    pb.LOGPROB_DTYPE_FLOAT32: 4,
    pb.LOGPROB_DTYPE_FLOAT16: 2,
    pb.LOGPROB_DTYPE_BFLOAT16: 2,
}
if not np.little_endian:  # pragma: no cover - every supported platform is little-endian
    raise ImportError("topk-distill's decoding assumes a little-endian host")
_LE_I32 = np.dtype("<i4")
_LE_F32 = np.dtype("<f4")
_LE_F16 = np.dtype("<f2")
_LE_U16 = np.dtype("<u2")


def dtype_from_name(name: str | int) -> int:
    """``"float16"`` -> ``LOGPROB_DTYPE_FLOAT16``; enum values pass through (DEFAULT ->
    FLOAT16). Raises ``ValueError`` naming ``dtype`` for anything else."""
    if isinstance(name, int) and not isinstance(name, bool):
        if name == pb.LOGPROB_DTYPE_DEFAULT:
            return pb.LOGPROB_DTYPE_FLOAT16
        if name in _ENUM_TO_NAME:
            return name
        raise ValueError(f"dtype: unknown log-prob dtype enum {name}; use one of {DTYPE_NAMES}")
    if isinstance(name, str) and name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    raise ValueError(f"dtype: unknown log-prob dtype {name!r}; use one of {sorted(DTYPE_NAMES)}")


def dtype_name(value: int) -> str:
    """``LOGPROB_DTYPE_FLOAT16`` -> ``"float16"``."""
    return _ENUM_TO_NAME[dtype_from_name(value)]


def itemsize(dtype: int) -> int:
    """Bytes per log-prob on the wire for a dtype enum."""
    return _ITEMSIZE[dtype_from_name(dtype)]


def _encode_floats(x: npt.ArrayLike, dtype: int) -> bytes:
    arr = np.asarray(x, dtype=np.float32)
    if dtype == pb.LOGPROB_DTYPE_FLOAT32:
        return arr.astype(_LE_F32, copy=False).tobytes()
    if dtype == pb.LOGPROB_DTYPE_FLOAT16:
        return arr.astype(_LE_F16).tobytes()
    return f32_to_bf16_bits(arr).tobytes()


def decode_floats_into(dst: npt.NDArray[np.float32], buf: bytes, dtype: int, field: str) -> None:
    """Decode ``buf`` (wire ``dtype``) into the float32 array ``dst`` in one vectorized copy.

    The only log-prob decoder: float16 and bfloat16 widen to float32 exactly. Raises
    ``ValueError`` naming ``field`` when ``buf`` does not hold ``dst.size`` values.
    """
    size = _ITEMSIZE[dtype]
    if len(buf) != dst.size * size:
        raise ValueError(
            f"{field}: expected {dst.size * size} bytes ({dst.size} x {size}), got {len(buf)}"
        )
    if dtype == pb.LOGPROB_DTYPE_FLOAT32:
        dst[...] = np.frombuffer(buf, dtype=_LE_F32).reshape(dst.shape)
    elif dtype == pb.LOGPROB_DTYPE_FLOAT16:
        dst[...] = np.frombuffer(buf, dtype=_LE_F16).reshape(dst.shape)
    else:  # bfloat16: the upper 16 bits of a float32, written straight into the halves
        halves = dst.view(_LE_U16).reshape(*dst.shape, 2)
        halves[..., 0] = 0
        halves[..., 1] = np.frombuffer(buf, dtype=_LE_U16).reshape(dst.shape)


def _decode_floats(
    buf: bytes, dtype: int, shape: tuple[int, ...], field: str
) -> npt.NDArray[np.float32]:
    out = np.empty(shape, dtype=np.float32)
    decode_floats_into(out, buf, dtype, field)
    return out


def encode_token_ids(token_ids: npt.ArrayLike) -> bytes:
    """``[L]`` integer token ids -> int32 little-endian bytes."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids: expected integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token_ids: values must fit in int32")
    return arr.astype(_LE_I32, copy=False).tobytes()


def decode_token_ids(buf: bytes) -> npt.NDArray[np.int32]:
    """int32 little-endian bytes -> ``[L]`` int32 array (read-only view of ``buf``)."""
    if len(buf) % 4:
        raise ValueError(f"token_ids: byte length {len(buf)} is not a multiple of 4 (int32)")
    return np.frombuffer(buf, dtype=_LE_I32)


def encode_sequence(
    arrays: SequenceArrays,
    *,
    dtype: int | str = "float16",
    sequence_index: int = 0,
    packing: Packing | None = None,
) -> pb.SequencePayload:
    """Pack one sequence's payload (``arrays``: ``[S, K]`` ids and log-probs, ``[S]``
    sampled log-probs and ``[S, C]`` candidate log-probs when present) in the wire
    ``dtype`` (name or enum); ``sequence_index``: the sequence's index in its request;
    ``packing``: the packed encoding's bit widths (None: the default encoding). The
    candidate ids are the request's and do not travel back; their log-probs travel
    unpacked in ``dtype`` in either encoding."""
    s, k = arrays.ids.shape
    enum = dtype_from_name(dtype)
    msg = pb.SequencePayload(
        sequence_index=sequence_index,
        position_start=arrays.position_start,
        num_positions=s,
        top_k=k,
        dtype=enum,  # type: ignore[arg-type]
    )
    if packing is None:
        msg.ids = arrays.ids.astype(_LE_I32, copy=False).tobytes()
        msg.logprobs = _encode_floats(arrays.logprobs, enum)
    else:
        _encode_packed(msg, arrays, packing)
    if arrays.sampled_logprobs is not None:
        msg.sampled_logprobs = _encode_floats(arrays.sampled_logprobs, enum)
    if arrays.candidate_logprobs is not None:
        msg.num_candidates = arrays.num_candidates
        msg.candidate_logprobs = _encode_floats(arrays.candidate_logprobs, enum)
    if arrays.sample_counts is not None:
        msg.sample_counts = arrays.sample_counts.astype(np.uint8, copy=False).tobytes()
    if arrays.proposal_log_normalizer is not None:
        msg.proposal_log_normalizer = _encode_floats(arrays.proposal_log_normalizer, enum)
    return msg


def _encode_packed(msg: pb.SequencePayload, arrays: SequenceArrays, packing: Packing) -> None:
    """The packed fields of ``msg`` (whose dtype is set) from ``arrays``' ids and log-probs."""
    ids = arrays.ids
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >> packing.id_bits):
        raise ValueError(f"ids: outside [0, 2**{packing.id_bits}) (id_bits {packing.id_bits})")
    bits = packing.logprob_bits
    ends, codes = quantize_logprobs(arrays.logprobs, bits, dtype_name(int(msg.dtype)))
    msg.encoding = pb.PAYLOAD_ENCODING_PACKED
    msg.id_bits = packing.id_bits
    msg.logprob_bits = bits
    msg.packed_ids = pack_uint(ids, packing.id_bits)
    msg.packed_logprobs = _encode_floats(ends, int(msg.dtype)) + pack_uint(codes, bits)


def decode_packed_into(
    ids: npt.NDArray[np.integer], logprobs: npt.NDArray[np.float32], msg: pb.SequencePayload
) -> None:
    """Decode a packed payload's ``[S, K]`` ids and log-probs into ``ids`` (any integer
    dtype) and ``logprobs`` (float32), C-contiguous, with vectorised bit operations.
    ``ValueError`` naming the field when a byte length does not fit the shape."""
    s, k = int(msg.num_positions), int(msg.top_k)
    if not 1 <= int(msg.id_bits) <= 32 or not 1 <= int(msg.logprob_bits) <= 32:
        raise ValueError(f"id_bits/logprob_bits: {msg.id_bits}/{msg.logprob_bits} not in [1, 32]")
    try:
        unpack_uint(msg.packed_ids, int(msg.id_bits), s * k, out=ids)
    except ValueError as e:
        raise ValueError(f"packed_ids: {e}") from None
    enum = dtype_from_name(int(msg.dtype))
    n_ends = s * ENDS_PER_ROW * _ITEMSIZE[enum]
    ends = np.empty((s, ENDS_PER_ROW), np.float32)
    buf = memoryview(msg.packed_logprobs)
    want = n_ends + uint_bytes(s * max(k - 2, 0), int(msg.logprob_bits))
    if len(buf) != want:
        raise ValueError(
            f"packed_logprobs: expected {want} bytes for [{s}, {k}] at "
            f"{msg.logprob_bits} bits, got {len(buf)}"
        )
    decode_floats_into(ends, bytes(buf[:n_ends]), enum, "packed_logprobs")
    codes = unpack_uint(buf[n_ends:], int(msg.logprob_bits), s * max(k - 2, 0))
    dequantize_logprobs(ends, codes.reshape(s, max(k - 2, 0)), int(msg.logprob_bits), logprobs)


def decode_sequence_into(out: Mapping[str, npt.NDArray[Any]], msg: pb.SequencePayload) -> None:
    """Decode a ``SequencePayload``'s rows into ``out``'s arrays, one vectorized copy each.

    ``out`` maps field names of :class:`~topk_protocol.arrays.SequenceArrays` to arrays of
    the message's shape (``[S, K]``, ``[S]``, ``[S, C]``; any numeric dtype the values fit,
    e.g. slices of a padded batch): ``ids`` and ``logprobs`` are required, each other wire
    field in ``out`` is decoded from its bytes (log-probs from the message's dtype, the
    integer fields from their :data:`~topk_protocol.arrays.WIRE_FIELDS` dtype), fields
    not in ``out`` are skipped; candidate ids are the request's and never travel.
    ``ValueError`` naming the field when a byte length does not fit.
    """
    enum = dtype_from_name(int(msg.dtype))
    ids, logprobs = out["ids"], out["logprobs"]
    if msg.encoding == pb.PAYLOAD_ENCODING_PACKED:
        decode_packed_into(ids, logprobs, msg)
    else:
        raw = msg.ids  # read once: each read of a bytes field may copy it
        if len(raw) != ids.size * 4:
            raise ValueError(f"ids: expected {ids.size * 4} bytes, got {len(raw)}")
        ids[...] = np.frombuffer(raw, dtype=_LE_I32).reshape(ids.shape)
        del raw  # freed before the next field's bytes are read: the allocator reuses it
        decode_floats_into(logprobs, msg.logprobs, enum, "logprobs")
    for name, wire_dtype in _OTHER_FIELDS:
        dst = out.get(name)
        if dst is None:
            continue
        buf = getattr(msg, name)  # read once: each read of a bytes field may copy it
        if wire_dtype is None:
            decode_floats_into(dst, buf, enum, name)
            continue
        if len(buf) != dst.size * wire_dtype.itemsize:
            raise ValueError(
                f"{name}: expected {dst.size * wire_dtype.itemsize} bytes, got {len(buf)}"
            )
        dst[...] = np.frombuffer(buf, dtype=wire_dtype).reshape(dst.shape)


#: Fields :func:`decode_sequence_into` does not decode from their own bytes: ids and
#: log-probs (decoded first, packed or not) and the request's candidate ids.
_NOT_DECODED = frozenset({"ids", "logprobs", "candidate_ids"})
#: The other wire fields, each with its little-endian wire dtype (None: log-probs in
#: the message's dtype), worked out once from the field table rather than per message.
_OTHER_FIELDS: tuple[tuple[str, np.dtype[Any] | None], ...] = tuple(
    (f.name, None if f.dtype is np.float32 else np.dtype(f.dtype).newbyteorder("<"))
    for f in WIRE_FIELDS
    if f.name not in _NOT_DECODED
)


def _check_shape(msg: pb.SequencePayload) -> tuple[int, int, int]:
    s, k = int(msg.num_positions), int(msg.top_k)
    enum = dtype_from_name(int(msg.dtype))
    if msg.encoding == pb.PAYLOAD_ENCODING_PACKED:
        return s, k, enum
    if len(msg.ids) != s * k * 4:
        raise ValueError(
            f"ids: expected {s * k * 4} bytes for [{s}, {k}] int32, got {len(msg.ids)}"
        )
    return s, k, enum


def decode_sequence(
    msg: pb.SequencePayload, candidate_ids: npt.ArrayLike | None = None
) -> SequenceArrays:
    """``SequencePayload`` -> numpy arrays (float32 log-probs whatever the wire dtype).

    ``ids`` is a read-only view of the message's bytes (a packed message's are decoded
    into new arrays: :func:`decode_packed_into`). A message with no rows decodes
    with empty sampled log-probs (an empty range sends none either way).
    ``candidate_ids``: the ``[S, C]`` ids the request named for these rows (the payload
    carries only their log-probs), required when the message has candidate log-probs
    (``ValueError`` naming the field otherwise)."""
    s, k, enum = _check_shape(msg)
    if msg.encoding == pb.PAYLOAD_ENCODING_PACKED:
        ids = np.empty((s, k), np.int32)
        lp = np.empty((s, k), np.float32)
        decode_packed_into(ids, lp, msg)
    else:
        ids = np.frombuffer(msg.ids, dtype=_LE_I32).reshape(s, k)
        lp = _decode_floats(msg.logprobs, enum, (s, k), "logprobs")
    sp = (
        _decode_floats(msg.sampled_logprobs, enum, (s,), "sampled_logprobs")
        if msg.sampled_logprobs
        else (None if s else np.zeros(0, np.float32))
    )
    counts = None
    if msg.sample_counts:
        if len(msg.sample_counts) != s * k:
            raise ValueError(
                f"sample_counts: expected {s * k} bytes for [{s}, {k}] uint8, "
                f"got {len(msg.sample_counts)}"
            )
        counts = np.frombuffer(msg.sample_counts, dtype=np.uint8).reshape(s, k)
    log_z = (
        _decode_floats(msg.proposal_log_normalizer, enum, (s,), "proposal_log_normalizer")
        if msg.proposal_log_normalizer
        else None
    )
    cand, clp = _decode_candidates(msg, candidate_ids, s, enum)
    return SequenceArrays(
        ids,
        lp,
        sp,
        int(msg.position_start),
        cand,
        clp,
        sample_counts=counts,
        proposal_log_normalizer=log_z,
    )


def _decode_candidates(
    msg: pb.SequencePayload, candidate_ids: npt.ArrayLike | None, s: int, enum: int
) -> tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]:
    """The ``[S, C]`` candidate ids and their decoded log-probs (None, None without)."""
    c = int(msg.num_candidates)
    if not c:
        if len(msg.candidate_logprobs):
            raise ValueError("candidate_logprobs: bytes present with num_candidates 0")
        return None, None
    if candidate_ids is None:
        raise ValueError(
            "candidate_ids: the payload has candidate log-probs; pass the request's "
            "candidate ids of these rows"
        )
    cand = np.asarray(candidate_ids, dtype=np.int32)
    if cand.shape != (s, c):
        raise ValueError(f"candidate_ids: expected [{s}, {c}], got {list(cand.shape)}")
    return cand, _decode_floats(msg.candidate_logprobs, enum, (s, c), "candidate_logprobs")
