"""The teacher's one cast of its float32 log-probs to a wire dtype, and bfloat16 bits.

The wire codec (:mod:`topk_protocol.codec`), the packed encoding's row ends
(:mod:`topk_protocol.packing`) and recordings (:mod:`topk_protocol.recording`) cast with
these functions, so a value cast anywhere is the value the wire carries. Pure numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["bf16_bits_to_f32", "cast_floats", "cast_like_teacher", "f32_to_bf16_bits"]

_LE_F32 = np.dtype("<f4")
_LE_U16 = np.dtype("<u2")
_LE_U32 = np.dtype("<u4")


def f32_to_bf16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, round-to-nearest-even, NaN kept quiet NaN."""
    u = np.ascontiguousarray(x, dtype=_LE_F32).view(_LE_U32)
    rounding = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + rounding) >> np.uint32(16)).astype(_LE_U16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """bfloat16 bit patterns -> float32 (exact)."""
    return (bits.astype(_LE_U32) << np.uint32(16)).view(_LE_F32)


def cast_like_teacher(values: npt.ArrayLike, dtype: str) -> npt.NDArray[Any]:
    """float32 -> the teacher's cast to ``dtype`` (name): float16 with numpy's
    round-to-nearest-even (returned as float16); bfloat16 rounded to nearest even,
    returned widened to float32 exactly; float32 unchanged."""
    if dtype == "float32":
        return np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(values, dtype=np.float32).astype(np.float16)
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(values, dtype=np.float32)))


def cast_floats(values: npt.ArrayLike, dtype: str) -> npt.NDArray[np.float32]:
    """:func:`cast_like_teacher`, held as float32 (exact): the value a ``dtype`` payload
    decodes to."""
    return np.asarray(cast_like_teacher(values, dtype), dtype=np.float32)
