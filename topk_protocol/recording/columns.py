"""The Arrow record batch of a writer's buffered rows: one row a scored sequence.

Pure (arrays in, a ``pa.RecordBatch`` out): :class:`~topk_protocol.recording.writer.
RecordingWriter` turns each row it takes into a :class:`StoredRow` (:func:`stored_row`:
the values as the recording stores them, so a buffered float16 row holds 2 bytes a
log-prob, not 4) and calls :func:`record_batch` at each flush. Every array field of
:class:`~topk_protocol.arrays.SequenceArrays` (:data:`WIRE_FIELDS`) becomes a list
column in its storage dtype (a packed recording's ids and log-probs: the packed bytes),
and each row carries its checksum (:func:`~topk_protocol.recording.format.row_crc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol.arrays import WIRE_FIELDS, SequenceArrays
from topk_protocol.packing import Packing
from topk_protocol.recording.format import row_crc, storage_dtype
from topk_protocol.recording.packed import PACKED_COLUMNS, pack_row

__all__ = ["StoredRow", "record_batch", "stored_row"]


@dataclass(frozen=True, eq=False)
class StoredRow:
    """One buffered row as it will be stored: its sequence ``key``, ``token_ids`` ``[L]``
    int32, positions ``[position_start, position_end)`` and ``values``: array field name
    -> its ``[S, ...]`` array in the storage dtype (a packed recording's ``ids`` and
    ``logprobs``: the packed bytes, ``uint8``), or None when absent."""

    key: bytes
    token_ids: npt.NDArray[np.int32]
    position_start: int
    position_end: int
    values: dict[str, npt.NDArray[Any] | None]

    @property
    def nbytes(self) -> int:
        """Bytes of its token ids and values."""
        arrays = [self.token_ids, *self.values.values()]
        return sum(int(a.nbytes) for a in arrays if a is not None)


def stored_row(
    key: bytes,
    token_ids: npt.NDArray[np.int32],
    arrays: SequenceArrays,
    dtype: str,
    packing: Packing | None,
) -> StoredRow:
    """The stored form of ``arrays`` (values already cast as a ``dtype`` recording stores
    them, exact in its storage dtype; ``packing``: a packed recording's, else None)."""
    # The packed fields come packed; the others are cast to their storage dtype.
    values: dict[str, npt.NDArray[Any] | None] = (
        dict(pack_row(arrays, dtype, packing)) if packing is not None else {}
    )
    for f in WIRE_FIELDS:
        if f.name not in values:
            a = getattr(arrays, f.name)
            values[f.name] = None if a is None else np.ascontiguousarray(a, storage_dtype(f, dtype))
    return StoredRow(key, token_ids, arrays.position_start, arrays.position_end, values)


def _offsets(lengths: list[int] | npt.NDArray[np.int64]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))


def _list_column(
    rows: list[npt.NDArray[Any] | None], typ: pa.DataType, width: int = 0, ragged: bool = False
) -> pa.Array:
    """``[n_i]`` (or ``[n_i, width]``) arrays -> ``list<typ>`` (or
    ``list<fixed_size_list<typ, width>>``); ``ragged``: ``[n_i, c_i]`` arrays ->
    ``list<list<typ>>`` (each row its own width); a None row is a null list."""
    present = [r for r in rows if r is not None]
    lengths = np.array([0 if r is None else len(r) for r in rows], dtype=np.int64)
    offsets = _offsets(lengths)
    flat = np.concatenate([r.reshape(-1) for r in present]) if present else np.zeros(0)
    values = pa.array(flat, type=typ)
    if width:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    elif ragged:  # one list per position: [c_i] * n_i
        widths = np.concatenate(
            [np.full(len(r), r.shape[1], np.int64) for r in present] or [np.zeros(0, np.int64)]
        )
        values = pa.ListArray.from_arrays(_offsets(widths), values)
    if len(present) == len(rows):
        return pa.ListArray.from_arrays(offsets, values)
    mask = pa.array([r is None for r in rows], type=pa.bool_())
    return pa.ListArray.from_arrays(offsets, values, mask=mask)


def record_batch(
    rows: Sequence[StoredRow],
    schema: pa.Schema,
    top_k: int,
    dtype: str,
    packing: Packing | None,
) -> pa.RecordBatch:
    """The record batch of ``rows`` in ``schema`` (K ``top_k``, stored ``dtype``,
    ``packing``: a packed recording's, else None)."""
    columns = [
        pa.array([r.key for r in rows], pa.binary()),
        _list_column([r.token_ids for r in rows], pa.int32()),
        pa.array([r.position_start for r in rows], pa.int32()),
        pa.array([r.position_end for r in rows], pa.int32()),
    ]
    for f in WIRE_FIELDS:
        if packing is not None and f.name in PACKED_COLUMNS:
            columns.append(
                pa.array([np.asarray(r.values[f.name]).tobytes() for r in rows], pa.binary())
            )
            continue
        typ = pa.from_numpy_dtype(storage_dtype(f, dtype))
        width = top_k if f.columns else 0
        columns.append(
            _list_column([r.values[f.name] for r in rows], typ, width, ragged=f.candidates)
        )
    checksums = [
        row_crc(r.key, r.token_ids, r.position_start, r.position_end, r.values) for r in rows
    ]
    columns.append(pa.array(checksums, pa.uint32()))
    return pa.record_batch(columns, schema=schema)
