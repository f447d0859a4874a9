"""The packed payload encoding: bit-packed ids and log-probs on a per-row grid. Pure numpy.

A packed payload of ``S`` rows of ``K`` entries, vocabulary ``V``, holds (rules and the
reasons for them: ``docs/protocol.md``, "Packed payloads"):

- the ids at ``id_bits = ceil(log2 V)`` bits each (:func:`id_bits`), bit-packed
  (:func:`pack_uint`);
- each row's two ends, its first (largest) and last (smallest) log-prob, cast to the
  request's dtype exactly as an unpacked payload casts them (``[S, 2]``, the "ends");
- the ``K - 2`` log-probs between them as ``logprob_bits``-bit codes ``q`` on the row's
  affine grid ``hi - q * step``, ``step = max((hi - lo) / (2**bits - 1), the float32
  floor)`` (:func:`grid_step`), rounded to the nearest grid point.

Every value decodes within :func:`error_bound` of the float32 value it was packed from:
half a grid step plus the ends' dtype rounding (0 for float32). Packing is
idempotent: packing decoded rows again gives the same bytes (what lets a recording hold
the packed bytes and a replay answer re-pack them identically). No loop per entry:
:func:`unpack_uint` and :func:`pack_uint` loop over the 8 entries of a group only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol.floats import cast_floats

__all__ = [
    "DEFAULT_LOGPROB_BITS",
    "ENDS_PER_ROW",
    "Packing",
    "dequantize_logprobs",
    "error_bound",
    "grid_step",
    "id_bits",
    "pack_uint",
    "packed_bytes_per_position",
    "packed_payload_bytes",
    "packed_roundtrip",
    "packed_row_bytes",
    "quantize_logprobs",
    "uint_bytes",
    "unpack_uint",
]

#: ``logprob_bits`` of a packed request that leaves it unset. At K = 64 and
#: V = 151,936 it gives 212 bytes per position (0.55x of the float16 payload's 386).
DEFAULT_LOGPROB_BITS = 8
#: Values per row the ends take: the row's first and last log-prob.
ENDS_PER_ROW = 2
#: The grid step is at least this many float32 spacings of the row's largest magnitude,
#: so that decoded values re-pack to the same codes (a finer grid than float32 can hold
#: would not survive the decoder's float32 output).
MIN_STEP_SPACINGS = 8
_GROUP = 8  # values per group of the bit-packed part: 8 values of r bits fill r bytes


def id_bits(vocab_size: int) -> int:
    """Bits of one packed id: ``ceil(log2 V)`` (at least 1): 18 for V = 151,936."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: {vocab_size} is not >= 1")
    return max(1, (int(vocab_size) - 1).bit_length())


@dataclass(frozen=True)
class Packing:
    """How one packed payload packs: ids at ``id_bits``, log-prob codes at
    ``logprob_bits``."""

    id_bits: int
    logprob_bits: int

    @classmethod
    def of(cls, vocab_size: int, logprob_bits: int = DEFAULT_LOGPROB_BITS) -> Packing:
        """The packing of a teacher with ``vocab_size`` tokens."""
        return cls(id_bits(vocab_size), int(logprob_bits))


# -- unsigned integers at a given bit width --------------------------------------------------
def uint_bytes(count: int, bits: int) -> int:
    """Bytes :func:`pack_uint` takes for ``count`` values of ``bits`` bits:
    ``count * (bits // 8) + (bits % 8) * ceil(count / 8)`` (``count * bits / 8`` when
    ``count`` is a multiple of 8)."""
    whole, rest = divmod(bits, 8)
    return count * whole + rest * -(-count // _GROUP)


def pack_uint(values: npt.ArrayLike, bits: int) -> bytes:
    """``[n]`` unsigned values below ``2**bits`` (``1 <= bits <= 32``) -> bytes.

    Layout: the low ``8 * (bits // 8)`` bits of every value as little-endian integers of
    ``bits // 8`` bytes, then the remaining ``r = bits % 8`` high bits, 8 values per ``r``
    bytes (value ``j`` of a group at bits ``[j * r, (j + 1) * r)`` of the group's
    little-endian integer), the last group zero-padded. Byte-aligned parts decode with
    one ``frombuffer``; the rest in 8 vectorised shifts (why not a plain bit stream: a
    value straddling bytes at every offset costs a gather per byte it spans).
    """
    v = np.ascontiguousarray(values, dtype=np.uint32).reshape(-1)
    whole, rest = divmod(bits, 8)
    parts: list[bytes] = []
    if whole:
        low = v if whole == 4 else v & np.uint32((1 << (8 * whole)) - 1)
        parts.append(low.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :whole].tobytes())
    if rest:
        groups = -(-v.size // _GROUP)
        flat = np.zeros(groups * _GROUP, np.uint64)
        flat[: v.size] = v >> np.uint32(8 * whole)
        high = flat.reshape(groups, _GROUP)
        word = np.zeros(groups, np.uint64)
        for j in range(_GROUP):  # a loop over the 8 values of a group, not per entry
            word |= high[:, j] << np.uint64(j * rest)
        parts.append(word.astype("<u8").view(np.uint8).reshape(groups, 8)[:, :rest].tobytes())
    return b"".join(parts)


_WORDS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _high_bits(raw: npt.NDArray[np.uint8], rest: int, count: int) -> npt.NDArray[np.uint32]:
    """The ``rest``-bit parts of ``count`` values, 8 per ``rest`` bytes -> ``[count]``."""
    groups = -(-count // _GROUP)
    width = next(w for w in _WORDS if w >= rest)  # the group as one little-endian word
    if width == rest:
        word = raw.view(_WORDS[width])
    else:
        padded = np.zeros((groups, width), np.uint8)
        padded[:, :rest] = raw.reshape(groups, rest)
        word = padded.view(_WORDS[width]).reshape(groups)
    shifts = np.arange(0, _GROUP * rest, rest, dtype=word.dtype)
    high = (word[:, None] >> shifts) & word.dtype.type((1 << rest) - 1)
    return high.reshape(-1)[:count].astype(np.uint32, copy=False)


def unpack_uint(
    buf: bytes | memoryview, bits: int, count: int, out: npt.NDArray[Any] | None = None
) -> npt.NDArray[Any]:
    """Inverse of :func:`pack_uint`: ``count`` values of ``bits`` bits from ``buf`` into
    ``out`` (``[count]`` integers, any shape of that size), or returned: a read-only view
    of ``buf`` for 8, 16 and 32 bits (no copy), else a new uint32 array. ``ValueError``
    naming the byte count when ``buf`` holds another size."""
    want = uint_bytes(count, bits)
    if len(buf) != want:
        raise ValueError(f"expected {want} bytes for {count} values of {bits} bits, got {len(buf)}")
    raw = np.frombuffer(buf, np.uint8)
    whole, rest = divmod(bits, 8)
    n_low = count * whole
    if not rest and whole in _WORDS:
        values = raw.view(_WORDS[whole])
        if out is None:
            return values
        out.reshape(-1)[...] = values
        return out
    # Work in uint32, in ``out`` itself when it is a C-contiguous 32-bit integer array.
    own = out is not None and out.dtype.itemsize == 4 and out.flags.c_contiguous
    u = out.reshape(-1).view(np.uint32) if own else np.empty(count, np.uint32)  # type: ignore[union-attr]
    if whole == 3:
        b = raw[:n_low].reshape(count, 3).astype(np.uint32)
        u[...] = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    elif whole:
        u[...] = raw[:n_low].view(_WORDS[whole])
    if rest:
        high = _high_bits(raw[n_low:], rest, count)
        if whole:
            np.left_shift(high, np.uint32(8 * whole), out=high)
            np.bitwise_or(u, high, out=u)
        else:
            u[...] = high
    if out is None:
        return u
    if not own:
        out.reshape(-1)[...] = u
    return out


# -- log-probs on a per-row grid ------------------------------------------------------------
def grid_step(ends: npt.NDArray[np.float32], bits: int) -> npt.NDArray[np.float32]:
    """``[..., 2]`` row ends (hi, lo) -> ``[...]`` the grid step of each row: ``(hi - lo)
    / (2**bits - 1)`` in float32, at least :data:`MIN_STEP_SPACINGS` float32 spacings of
    ``max(|hi|, |lo|)`` (so also > 0)."""
    hi, lo = ends[..., 0], ends[..., 1]
    levels = np.float32((1 << bits) - 1)
    floor = np.float32(MIN_STEP_SPACINGS) * np.spacing(np.maximum(np.abs(hi), np.abs(lo)))
    return np.maximum((hi - lo) / levels, floor).astype(np.float32)


def quantize_logprobs(
    logprobs: npt.ArrayLike, bits: int, dtype: str = "float16"
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint32]]:
    """``[..., K]`` float32 log-probs, each row sorted descending and finite ->
    ``(ends [..., 2] float32, codes [..., K - 2] uint32)``.

    ``ends`` are the row's first and last value cast to ``dtype`` (the values an unpacked
    ``dtype`` payload carries); ``codes`` the nearest points ``q`` of the grid ``hi - q *
    step`` (:func:`grid_step`) for the entries between them. ``ValueError`` naming
    ``logprobs`` for a non-finite value or an unsorted row."""
    x = np.asarray(logprobs, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"logprobs: expected [..., K] with K >= 1, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("logprobs: the packed encoding needs finite log-probs")
    if x.shape[-1] > 1 and (np.diff(x, axis=-1) > 0).any():
        raise ValueError("logprobs: the packed encoding needs rows sorted descending")
    ends = cast_floats(np.stack([x[..., 0], x[..., -1]], axis=-1), dtype)
    step = grid_step(ends, bits)[..., None]
    hi = ends[..., :1]
    # The grid point nearest the last value: no code goes past it, so that decoded rows
    # stay sorted and decoded values re-pack to their own codes (dequantize_logprobs).
    last = np.rint((hi - ends[..., 1:]) / step)
    q = np.minimum(np.rint((hi - x[..., 1:-1]) / step), last)
    codes = np.clip(q, 0, (1 << bits) - 1).astype(np.uint32)
    return ends, codes


def dequantize_logprobs(
    ends: npt.NDArray[np.float32],
    codes: npt.NDArray[Any],
    bits: int,
    out: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """``ends [..., 2]``, ``codes [..., K - 2]`` -> ``[..., K]`` float32 log-probs
    (``K = 1`` when ``codes`` is empty and both ends are equal is not distinguishable
    from ``K = 2``: pass ``out`` of the right shape for ``K = 1``)."""
    k = codes.shape[-1] + 2
    dst = np.empty((*codes.shape[:-1], k), np.float32) if out is None else out
    if dst.shape[-1] == 1:
        dst[..., 0] = ends[..., 0]
        return dst
    step = grid_step(ends, bits)
    hi = ends[..., 0]
    inner = dst[..., 1:-1]
    np.multiply(codes, step[..., None], out=inner, casting="unsafe")
    np.subtract(hi[..., None], inner, out=inner)
    np.maximum(inner, ends[..., 1:], out=inner)  # no value below the row's last
    dst[..., 0] = hi
    dst[..., -1] = ends[..., 1]
    return dst


def error_bound(
    logprobs: npt.ArrayLike, bits: int, dtype: str = "float16"
) -> npt.NDArray[np.float32]:
    """``[..., K]`` float32 rows -> ``[...]`` the most any packed value of the row can
    differ from it: ``step / 2 + max(|hi - cast(hi)|, |lo - cast(lo)|)`` (the ends'
    dtype rounding: 0 for float32) plus 8 float32 spacings of the row's largest
    magnitude for the arithmetic."""
    x = np.asarray(logprobs, dtype=np.float32)
    raw = np.stack([x[..., 0], x[..., -1]], axis=-1)
    ends = cast_floats(raw, dtype)
    cast_error = np.abs(raw - ends).max(axis=-1)
    slack = MIN_STEP_SPACINGS * np.spacing(np.abs(x).max(axis=-1))
    return (grid_step(ends, bits) / 2 + cast_error + slack).astype(np.float32)


def packed_roundtrip(
    logprobs: Any, bits: int = DEFAULT_LOGPROB_BITS, dtype: str = "float16"
) -> Any:
    """What a packed payload decodes to: ``[..., K]`` log-probs (rows sorted descending;
    numpy or a torch tensor) quantized and dequantized exactly as the wire does it, same
    type, shape and (torch) device back."""
    if hasattr(logprobs, "detach"):  # a torch tensor: numpy on the CPU and back
        import torch

        x = logprobs.detach().to("cpu", torch.float32).numpy()
        return torch.from_numpy(packed_roundtrip(x, bits, dtype)).to(logprobs.device)
    x = np.asarray(logprobs, dtype=np.float32)
    ends, codes = quantize_logprobs(x, bits, dtype)
    return dequantize_logprobs(ends, codes, bits, out=np.empty_like(x))


# -- sizes -------------------------------------------------------------------------------
def packed_payload_bytes(
    num_positions: int,
    top_k: int,
    vocab_size: int,
    logprob_bits: int = DEFAULT_LOGPROB_BITS,
    dtype_itemsize: int = 2,
    include_sampled: bool = True,
) -> int:
    """Exact bytes of the arrays of one packed payload (or chunk) of ``num_positions``
    rows: ids + ends + codes (+ sampled log-probs, ``dtype_itemsize`` bytes each)."""
    n = num_positions
    ends = n * ENDS_PER_ROW * dtype_itemsize
    sampled = n * dtype_itemsize if include_sampled else 0
    codes = uint_bytes(n * max(top_k - 2, 0), logprob_bits)
    return uint_bytes(n * top_k, id_bits(vocab_size)) + ends + codes + sampled


def packed_bytes_per_position(
    top_k: int,
    vocab_size: int,
    logprob_bits: int = DEFAULT_LOGPROB_BITS,
    dtype_itemsize: int = 2,
    include_sampled: bool = True,
) -> float:
    """Bytes per position of a long packed payload (the limit of
    :func:`packed_payload_bytes` / rows): ``K * ceil(log2 V) / 8 + (K - 2) * bits / 8 +
    (2 + include_sampled) * itemsize``; 212.0 at K = 64, V = 151,936, 8 bits, float16."""
    return (
        top_k * id_bits(vocab_size) / 8
        + max(top_k - 2, 0) * logprob_bits / 8
        + (ENDS_PER_ROW + int(include_sampled)) * dtype_itemsize
    )


def packed_row_bytes(
    top_k: int, vocab_size: int, logprob_bits: int, dtype_itemsize: int, include_sampled: bool
) -> int:
    """One row's share of a packed payload in whole bytes, what the one-message rule and
    stream chunking count: ``ceil`` of :func:`packed_bytes_per_position`. A payload of
    ``S`` rows takes at most ``S`` times this plus 14 bytes (the last, zero-padded group
    of each bit-packed part), which the framing allowance per payload covers."""
    return math.ceil(
        packed_bytes_per_position(top_k, vocab_size, logprob_bits, dtype_itemsize, include_sampled)
    )
