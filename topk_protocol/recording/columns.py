"""The Arrow record batch of a writer's buffered rows: one row a scored sequence.

Pure (arrays in, a ``pa.RecordBatch`` out): :class:`~topk_protocol.recording.writer.
RecordingWriter` buffers rows and calls :func:`record_batch` at each flush. Every array
field of :class:`~topk_protocol.arrays.SequenceArrays` (:data:`ARRAY_FIELDS`) becomes a
list column in its storage dtype (a packed recording's ids and log-probs: the packed
bytes), and each row carries its checksum (:func:`~topk_protocol.recording.format.row_crc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol.arrays import ARRAY_FIELDS, SequenceArrays
from topk_protocol.packing import Packing
from topk_protocol.recording.format import row_crc, storage_dtype
from topk_protocol.recording.packed import PACKED_COLUMNS, pack_row

__all__ = ["BufferedRow", "record_batch"]

#: A buffered row: (sequence key, token ids ``[L]``, arrays already cast to the stored dtype).
BufferedRow = tuple[bytes, npt.NDArray[np.int32], SequenceArrays]


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
    rows: Sequence[BufferedRow],
    schema: pa.Schema,
    top_k: int,
    dtype: str,
    packing: Packing | None,
) -> pa.RecordBatch:
    """The record batch of ``rows`` in ``schema`` (K ``top_k``, stored ``dtype``,
    ``packing``: a packed recording's, else None)."""
    # Each row's array fields in the storage dtype (exact: the values were cast),
    # a packed recording's ids and log-probs as the packed bytes.
    stored: list[dict[str, Any]] = [
        {
            f.name: None
            if getattr(a, f.name) is None
            else getattr(a, f.name).astype(storage_dtype(f, dtype), copy=False)
            for f in ARRAY_FIELDS
        }
        for _, _, a in rows
    ]
    if packing is not None:
        for values, (_, _, a) in zip(stored, rows, strict=True):
            values.update(pack_row(a, dtype, packing))
    columns = [
        pa.array([k for k, _, _ in rows], pa.binary()),
        _list_column([t for _, t, _ in rows], pa.int32()),
        pa.array([a.position_start for _, _, a in rows], pa.int32()),
        pa.array([a.position_end for _, _, a in rows], pa.int32()),
    ]
    for f in ARRAY_FIELDS:
        if packing is not None and f.name in PACKED_COLUMNS:
            columns.append(pa.array([np.asarray(v[f.name]).tobytes() for v in stored], pa.binary()))
            continue
        typ = pa.from_numpy_dtype(storage_dtype(f, dtype))
        width = top_k if f.columns else 0
        columns.append(_list_column([v[f.name] for v in stored], typ, width, ragged=f.candidates))
    checksums = [
        row_crc(k, t, a.position_start, a.position_end, v)
        for (k, t, a), v in zip(rows, stored, strict=True)
    ]
    columns.append(pa.array(checksums, pa.uint32()))
    return pa.record_batch(columns, schema=schema)
