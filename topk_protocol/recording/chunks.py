"""What a recording reader holds per record batch: numpy views of its columns (``Chunk``,
each row verified as it is read), where the batch lies (``Slot``), and the byte counter
of the pass that indexes a remote shard (``Tally``)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol.arrays import WIRE_FIELDS, SequenceArrays
from topk_protocol.errors import RecordingDamagedError
from topk_protocol.packing import Packing
from topk_protocol.recording.format import (
    METADATA_FILE,
    row_crc,
)
from topk_protocol.recording.integrity import CHECKSUM_COLUMN
from topk_protocol.recording.packed import PACKED_COLUMNS, packed_problem, unpack_row
from topk_protocol.storage import Location

__all__ = ["Chunk", "Slot", "StoredRow", "Tally"]


#: A row as read: ``(token_ids [L] int32, field name -> its array in the storage dtype,
#: or None when absent)``.
StoredRow = tuple[npt.NDArray[np.int32], dict[str, Any]]


class Chunk:
    """numpy views of one record batch's columns (no copy for uncompressed shards).

    ``shard`` and ``first_row`` (the batch's first row within the shard) say where each
    row is, for the error that names a damaged one.
    """

    def __init__(
        self,
        batch: pa.RecordBatch,
        top_k: int,
        shard: Location,
        first_row: int,
        packing: tuple[str, Packing] | None = None,
    ) -> None:
        self.shard = shard
        self.top_k = top_k
        #: A packed recording's ``(dtype, packing)``: its ids and log-probs are bytes.
        self.packing = packing
        self.first_row = first_row
        self.num_rows = batch.num_rows
        self.keys: list[bytes] = batch.column("key").to_pylist()
        self.starts = batch.column("position_start").to_numpy()
        self.ends = batch.column("position_end").to_numpy()
        tok = batch.column("token_ids")
        self.tok_offsets = tok.offsets.to_numpy()
        self.tok_values = tok.values.to_numpy()
        names = batch.schema.names
        #: field name -> (row offsets, values ``[rows, K]`` or ``[rows]``, valid or None)
        self.arrays: dict[str, tuple[npt.NDArray[Any], npt.NDArray[Any], Any]] = {}
        #: candidate field name -> offsets of each position's ids into its values
        self.widths: dict[str, npt.NDArray[Any]] = {}
        for f in WIRE_FIELDS:
            if packing is not None and f.name in PACKED_COLUMNS:
                col = batch.column(PACKED_COLUMNS[f.name])
                _, offsets, data = col.buffers()
                starts = np.frombuffer(offsets, np.int32)[col.offset : col.offset + len(col) + 1]
                self.arrays[f.name] = (starts, np.frombuffer(data or b"", np.uint8), None)
                continue
            if f.name not in names:  # an optional field newer than the shard
                continue
            col = batch.column(f.name)
            values = col.values
            if f.candidates:  # list<list<v>>: positions, then each position's ids
                self.widths[f.name] = values.offsets.to_numpy()
                values = values.values
            flat = (values.flatten() if f.columns else values).to_numpy()
            valid = col.is_valid().to_numpy(zero_copy_only=False) if f.optional else None
            self.arrays[f.name] = (
                col.offsets.to_numpy(),
                flat.reshape(-1, top_k) if f.columns else flat,
                valid,
            )
        self.has_sampled = (
            self.arrays["sampled_logprobs"][2]
            if "sampled_logprobs" in self.arrays
            else np.zeros(self.num_rows, np.bool_)
        )
        self.checksums = (
            batch.column(CHECKSUM_COLUMN).to_numpy() if CHECKSUM_COLUMN in names else None
        )

    def stored(self, r: int) -> StoredRow:
        """Row ``r`` as stored (views), unverified."""
        tokens = self.tok_values[self.tok_offsets[r] : self.tok_offsets[r + 1]]
        values: dict[str, Any] = {}
        for f in WIRE_FIELDS:
            if f.name not in self.arrays:
                values[f.name] = None
                continue
            offsets, flat, valid = self.arrays[f.name]
            present = valid is None or bool(valid[r])
            a, b = offsets[r], offsets[r + 1]
            if not present:
                values[f.name] = None
            elif f.name in self.widths:  # [S, C]: every position of the row has C ids
                inner = self.widths[f.name][a : b + 1]
                c = int(inner[1] - inner[0]) if b > a else 0
                if np.any(np.diff(inner) != c):
                    raise ValueError(f"{f.name}: positions of one row differ in width")
                values[f.name] = flat[inner[0] : inner[-1]].reshape(b - a, c)
            else:
                values[f.name] = flat[a:b]
        return tokens, values

    def row(self, r: int, vocab_size: int) -> tuple[npt.NDArray[np.int32], SequenceArrays]:
        """Row ``r``, verified: its checksum (when the shard has them), that its arrays
        have the lengths its positions say, and that its ids lie in the vocabulary.
        Raises :class:`RecordingDamagedError` naming the shard and the row otherwise.
        Log-probs come widened to float32 (no copy for a float32 recording)."""
        try:
            tokens, values = self.stored(r)
        except ValueError:  # a candidate row whose positions have different widths
            raise RecordingDamagedError(
                self.shard, self.first_row + r, "its candidate rows differ in width"
            ) from None
        problem = self._problem(r, tokens, values, vocab_size)
        if problem is not None:
            raise RecordingDamagedError(self.shard, self.first_row + r, problem)
        start = int(self.starts[r])
        if self.packing is None:
            return tokens, SequenceArrays(**values, position_start=start)
        dtype, packing = self.packing
        arrays = unpack_row(values, start, int(self.ends[r]), self.top_k, dtype, packing)
        problem = self._ids_problem("ids", arrays.ids, vocab_size)
        if problem is not None:
            raise RecordingDamagedError(self.shard, self.first_row + r, problem)
        return tokens, arrays

    def _problem(
        self,
        r: int,
        tokens: npt.NDArray[np.int32],
        values: dict[str, npt.NDArray[Any] | None],
        vocab_size: int,
    ) -> str | None:
        start, end = int(self.starts[r]), int(self.ends[r])
        if not 0 <= start <= end <= len(tokens):
            return (
                f"positions [{start}, {end}) are not inside its "
                f"{len(tokens)} tokens: the shard is damaged"
            )
        lengths = {len(v) for v in values.values() if v is not None}
        if self.packing is not None:
            packed = packed_problem(values, end - start, self.top_k, *self.packing)
            if packed is not None:
                return packed
        elif lengths != {end - start}:
            return (
                f"its arrays hold {sorted(lengths)} rows for {end - start} positions: "
                "the shard is damaged"
            )
        if self.checksums is not None:
            crc = row_crc(self.keys[r], tokens, start, end, values)
            if crc != int(self.checksums[r]):
                return (
                    f"checksum mismatch ({CHECKSUM_COLUMN} {int(self.checksums[r]):#010x}, the "
                    f"row's bytes give {crc:#010x}): the shard is damaged; this row is not served"
                )
        ids = () if self.packing is not None else (("ids", values["ids"], 0),)
        for name, arr, low in (
            ("token_ids", tokens, 0),
            *ids,
            ("candidate_ids", values.get("candidate_ids"), -1),
        ):
            problem = self._ids_problem(name, arr, vocab_size, low)
            if problem is not None:
                return problem
        return None

    @staticmethod
    def _ids_problem(
        name: str, arr: npt.NDArray[Any] | None, vocab_size: int, low: int = 0
    ) -> str | None:
        """Why ``arr`` is outside ``[low, vocab_size)`` (None: it is inside)."""
        if arr is None or not arr.size:
            return None
        if int(arr.min()) < low or int(arr.max()) >= vocab_size:
            return (
                f"{name} [{int(arr.min())}, {int(arr.max())}] are outside the vocabulary "
                f"[{low}, {vocab_size}) of {METADATA_FILE}: the shard or {METADATA_FILE} "
                "is damaged"
            )
        return None


class Tally(io.RawIOBase):
    """A sequential stream that counts the bytes read from it: where each IPC message of
    a non-local shard starts and ends (pyarrow's own ``tell`` needs a seekable file, and
    a seekable S3 file makes one ranged request per read; this one reads ahead)."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.position = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.position += len(data)
        return bytes(data)

    def close(self) -> None:
        self._stream.close()
        super().close()


@dataclass
class Slot:
    """One record batch of the recording: its shard, its first row in that shard, its
    rows and positions, and the batch itself (a local shard: decoded or mapped when
    opened) or the byte range of its message in the shard (any other filesystem: fetched
    when one of its rows is read)."""

    shard: Location
    schema: pa.Schema
    first_row: int
    num_rows: int
    positions: int
    chunk: Chunk | None = None
    offset: int = 0
    length: int = 0
