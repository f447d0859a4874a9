"""Packed recordings: a row's ids and log-probs stored as the packed payload's bytes.

A recording made at ``encoding: "packed"`` (``metadata.json``; the packing in
:mod:`topk_protocol.packing`) stores, in place of the ``ids`` and ``logprobs`` list
columns, two ``binary`` columns holding each row's ``packed_ids`` and ``packed_logprobs``
exactly as the wire carries them for the row's positions; ``sampled_logprobs`` stays a
``list<F>`` column. The row checksum covers these bytes. Reading a row decodes them with
the wire's decoder, into the float32 :class:`~topk_protocol.arrays.SequenceArrays` every
reader hands on; packing those again gives the same bytes (packing is idempotent), which
is how a replay answers byte-identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.arrays import WIRE_FIELDS, SequenceArrays
from topk_protocol.codec import decode_sequence, dtype_from_name, encode_sequence, itemsize
from topk_protocol.packing import Packing, packed_payload_bytes

__all__ = ["PACKED_COLUMNS", "pack_row", "packed_problem", "unpack_row"]

#: The array field each packed column replaces: ``ids`` -> ``packed_ids`` and so on.
PACKED_COLUMNS = {"ids": "packed_ids", "logprobs": "packed_logprobs"}


def pack_row(arrays: SequenceArrays, dtype: str, packing: Packing) -> dict[str, npt.NDArray[Any]]:
    """The stored bytes of one row's ids and log-probs (``uint8`` arrays, keyed by the
    array field they replace): the packed payload's ``packed_ids`` and
    ``packed_logprobs`` for its positions."""
    msg = encode_sequence(arrays, dtype=dtype, packing=packing)
    return {
        field: np.frombuffer(getattr(msg, column), np.uint8)
        for field, column in PACKED_COLUMNS.items()
    }


def unpack_row(
    values: dict[str, Any], start: int, end: int, top_k: int, dtype: str, packing: Packing
) -> SequenceArrays:
    """A stored row of positions ``[start, end)`` (``values``: ``ids`` / ``logprobs`` the
    packed bytes, every other array field the stored array or None) decoded to float32."""
    n = end - start
    msg = pb.SequencePayload(
        position_start=start,
        num_positions=n,
        top_k=top_k,
        dtype=dtype_from_name(dtype),  # type: ignore[arg-type]
        encoding=pb.PAYLOAD_ENCODING_PACKED,
        id_bits=packing.id_bits,
        logprob_bits=packing.logprob_bits,
        packed_ids=bytes(values["ids"]),
        packed_logprobs=bytes(values["logprobs"]),
    )
    decoded = decode_sequence(msg)
    others = {f.name: values.get(f.name) for f in WIRE_FIELDS if f.name not in PACKED_COLUMNS}
    return SequenceArrays(decoded.ids, decoded.logprobs, position_start=start, **others)


def packed_problem(
    values: dict[str, Any], positions: int, top_k: int, dtype: str, packing: Packing
) -> str | None:
    """Why a stored packed row's bytes do not hold ``positions`` rows (None: they do)."""
    size = itemsize(dtype_from_name(dtype))
    want = packed_payload_bytes(
        positions, top_k, 1 << packing.id_bits, packing.logprob_bits, size, include_sampled=False
    )
    got = len(values["ids"]) + len(values["logprobs"])
    rows = {
        name: len(v) for name, v in values.items() if name not in PACKED_COLUMNS and v is not None
    }
    if got != want or set(rows.values()) - {positions}:
        return (
            f"its packed arrays hold {got} bytes (and {rows} rows of its other arrays) for "
            f"{positions} positions, which take {want} bytes: the shard is damaged"
        )
    return None
