"""Read a recording: every complete record batch of every shard, each row verified.

Integrity (:mod:`topk_protocol.integrity`): a row is verified each time it is read; a row
that fails, a batch or shard that does not parse, a shard whose schema disagrees with
``metadata.json`` is reported as a :class:`~topk_protocol.errors.RecordingDamagedError`
naming the shard (or ``metadata.json``) and the row, and the intact rows still replay.
Shards written before checksums (no ``row_crc32`` column) still open, with one warning.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol import RequestOptions
from topk_protocol._closeable import Closeable
from topk_protocol.arrays import ARRAY_FIELDS, SequenceArrays
from topk_protocol.errors import RecordingDamagedError
from topk_protocol.integrity import CHECKSUM_COLUMN
from topk_protocol.packing import Packing
from topk_protocol.recording.format import (
    METADATA_FILE,
    READ_ERRORS,
    check_schema,
    read_metadata,
    recording_packing,
    row_crc,
    sequence_key,
    shards,
)
from topk_protocol.recording.index import NOT_RECORDED, RowIndex
from topk_protocol.recording.packed import PACKED_COLUMNS, packed_problem, unpack_row

__all__ = ["RecordingReader"]

log = logging.getLogger(__name__)

#: A row as read: ``(token_ids [L] int32, field name -> its array in the storage dtype,
#: or None when absent)``.
_StoredRow = tuple[npt.NDArray[np.int32], dict[str, Any]]


class _Chunk:
    """numpy views of one record batch's columns (no copy for uncompressed shards).

    ``shard`` and ``first_row`` (the batch's first row within the shard) say where each
    row is, for the error that names a damaged one.
    """

    def __init__(
        self,
        batch: pa.RecordBatch,
        top_k: int,
        shard: Path,
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
        for f in ARRAY_FIELDS:
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

    def stored(self, r: int) -> _StoredRow:
        """Row ``r`` as stored (views), unverified."""
        tokens = self.tok_values[self.tok_offsets[r] : self.tok_offsets[r + 1]]
        values: dict[str, Any] = {}
        for f in ARRAY_FIELDS:
            if f.name not in self.arrays:
                values[f.name] = None
                continue
            offsets, flat, valid = self.arrays[f.name]
            present = valid is None or bool(valid[r])
            values[f.name] = flat[offsets[r] : offsets[r + 1]] if present else None
        return tokens, values

    def row(self, r: int, vocab_size: int) -> tuple[npt.NDArray[np.int32], SequenceArrays]:
        """Row ``r``, verified: its checksum (when the shard has them), that its arrays
        have the lengths its positions say, and that its ids lie in the vocabulary.
        Raises :class:`RecordingDamagedError` naming the shard and the row otherwise.
        Log-probs come widened to float32 (no copy for a float32 recording)."""
        tokens, values = self.stored(r)
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
        ids = () if self.packing is not None else (("ids", values["ids"]),)
        for name, arr in (("token_ids", tokens), *ids):
            problem = self._ids_problem(name, arr, vocab_size)
            if problem is not None:
                return problem
        return None

    @staticmethod
    def _ids_problem(name: str, arr: npt.NDArray[Any] | None, vocab_size: int) -> str | None:
        if arr is None or not arr.size:
            return None
        if int(arr.min()) < 0 or int(arr.max()) >= vocab_size:
            return (
                f"{name} [{int(arr.min())}, {int(arr.max())}] are outside the vocabulary "
                f"[0, {vocab_size}) of {METADATA_FILE}: the shard or {METADATA_FILE} is damaged"
            )
        return None


class RecordingReader(Closeable):
    """Reads a recording directory: every complete record batch of every shard.

    Attributes:
        info: the recorded teacher's ``TeacherInfo`` message.
        metadata: ``metadata.json`` as a dict.
        top_k, dtype: what the recording stores.
        temperature: the teacher's temperature when recorded.
        index: the :class:`~topk_protocol.recording.index.RowIndex` of its rows.
        skipped: one line per thing not read (a batch cut by a killed writer, an empty
            shard, a damaged batch or shard), naming the shard; also logged and warned.
        damaged: the :class:`RecordingDamagedError` of every shard or batch found damaged
            when opened (rows are verified when read: see :meth:`row`).
        unverified: shards without checksums (written before they existed).

    Raises :class:`RecordingError` naming ``metadata.json`` when it is not a recording's,
    and :class:`RecordingDamagedError` naming it when it disagrees with every shard's
    schema (K, dtype, vocabulary, tokenizer, temperature). Uncompressed shards are
    memory-mapped (rows are views); compressed ones are decompressed into memory when
    opened. Thread-safe for reads; works after ``fork``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata, self.info = read_metadata(self.path)
        self.top_k = int(self.metadata["top_k"])
        self.dtype = str(self.metadata["dtype"])
        self.temperature = float(self.metadata["temperature"])
        self._vocab_size = int(self.metadata["vocab_size"])
        #: A packed recording's packing (None: the default encoding).
        self.packing = recording_packing(self.metadata)
        #: The request options the recording was made at (``RequestOptions.recorded``;
        #: an option newer than the recording takes its default).
        self.options: dict[str, Any] = {
            **RequestOptions.recorded_defaults(),
            **self.metadata.get("options", {}),
        }
        self.skipped: list[str] = []
        self.damaged: list[RecordingDamagedError] = []
        self.unverified: list[str] = []
        self.index = RowIndex()
        self._maps: list[pa.MemoryMappedFile] = []
        self._chunks: list[_Chunk] = []
        disagreeing: list[tuple[Path, tuple[str, ...]]] = []
        agreeing = 0
        for shard in shards(self.path):
            stream = self._open_shard(shard)
            if stream is None:
                continue
            check = check_schema(stream.schema, self.metadata)
            if check.damage is not None:
                self._damage(shard, None, f"{check.damage}; none of its rows are served")
                continue
            if check.disagrees:
                disagreeing.append((shard, check.disagrees))
                continue
            agreeing += 1
            if not check.checksums:
                self.unverified.append(shard.name)
            for first_row, batch in self._read_batches(shard, stream):
                packed = None if self.packing is None else (self.dtype, self.packing)
                chunk = _Chunk(batch, self.top_k, shard, first_row, packed)
                self._chunks.append(chunk)
                self.index.extend(
                    chunk.keys,
                    chunk.starts.tolist(),
                    chunk.ends.tolist(),
                    chunk.has_sampled.tolist(),
                )
        if disagreeing and not agreeing:
            # Every shard says otherwise: it is metadata.json that is wrong.
            shard, what = disagreeing[0]
            raise RecordingDamagedError(
                self.path / METADATA_FILE,
                None,
                f"disagrees with every shard's schema ({len(disagreeing)}), e.g. "
                f"{shard.name}: " + "; ".join(what),
            )
        for shard, what in disagreeing:
            self._damage(shard, None, f"{'; '.join(what)}; none of its rows are served")
        self._chunk_start = np.cumsum([0] + [c.num_rows for c in self._chunks])
        for line in self.skipped:
            log.warning("%s", line)
            warnings.warn(line, stacklevel=2)
        if self.unverified:
            line = (
                f"recording {self.path}: {len(self.unverified)} shard(s) written without "
                f"checksums ({', '.join(self.unverified)}): their rows are served unverified "
                "(K, dtype and the vocabulary are still checked)"
            )
            log.warning("%s", line)
            warnings.warn(line, stacklevel=2)

    def _damage(self, shard: Path, row: int | None, message: str) -> None:
        err = RecordingDamagedError(shard, row, message)
        self.damaged.append(err)
        self.skipped.append(str(err))

    def _open_shard(self, shard: Path) -> pa.ipc.RecordBatchStreamReader | None:
        size = shard.stat().st_size
        if size == 0:
            self.skipped.append(f"recording {self.path}: {shard.name} is empty (0 bytes)")
            return None
        source = pa.memory_map(str(shard))
        self._maps.append(source)
        try:
            return pa.ipc.open_stream(source)
        except READ_ERRORS as e:
            self._damage(shard, None, f"no readable schema ({e}); none of its rows are served")
            return None

    def _read_batches(
        self, shard: Path, stream: pa.ipc.RecordBatchStreamReader
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """``(first row in the shard, batch)`` of the shard's batches that parse and
        validate; a batch that does not validate is reported and passed over, one that
        does not parse ends the shard."""
        n = rows = 0
        while True:
            try:
                batch = stream.read_next_batch()
            except StopIteration:
                return
            except READ_ERRORS as e:
                left = shard.stat().st_size - self._maps[-1].tell()
                self.skipped.append(
                    f"recording {self.path}: {shard.name}: kept {n} complete batches; skipped "
                    f"the {left} bytes after them (a batch cut short, e.g. by a killed "
                    f"writer, or damaged: {e})"
                )
                return
            n += 1
            try:
                batch.validate(full=True)
            except READ_ERRORS as e:
                self._damage(
                    shard,
                    None,
                    f"batch {n} (rows {rows} to {rows + batch.num_rows - 1}) does not "
                    f"validate ({e}); its rows are not served",
                )
            else:
                yield rows, batch
            rows += batch.num_rows

    # -- access ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows (recorded sequences)."""
        return len(self.index)

    @property
    def num_positions(self) -> int:
        return int(sum(int((c.ends - c.starts).sum()) for c in self._chunks))

    def row(self, i: int) -> tuple[npt.NDArray[np.int32], SequenceArrays]:
        """Row ``i`` (in shard order) as ``(token_ids [L] int32, arrays)``, verified
        (checksum, lengths, vocabulary); raises :class:`RecordingDamagedError` naming
        its shard and row when damaged."""
        if not 0 <= i < len(self.index):
            raise IndexError(f"row {i} of a recording with {len(self.index)} rows")
        c = int(np.searchsorted(self._chunk_start, i, side="right")) - 1
        return self._chunks[c].row(i - int(self._chunk_start[c]), self._vocab_size)

    def key(self, i: int) -> bytes:
        return self.index.key(i)

    def __iter__(self) -> Iterator[tuple[npt.NDArray[np.int32], SequenceArrays]]:
        """Every row, as :meth:`row` gives it."""
        for chunk in self._chunks:
            for r in range(chunk.num_rows):
                yield chunk.row(r, self._vocab_size)

    def verify(self) -> list[RecordingDamagedError]:
        """Read every row: the damage found when opening and in every row that fails."""
        found = list(self.damaged)
        for chunk in self._chunks:
            for r in range(chunk.num_rows):
                try:
                    chunk.row(r, self._vocab_size)
                except RecordingDamagedError as e:
                    found.append(e)
        return found

    def find(self, token_ids: bytes, start: int, end: int, sampled: bool) -> SequenceArrays | str:
        """The recorded row holding positions ``[start, end)`` of this sequence (with
        sampled log-probs when ``sampled``), whole, or a sentence saying what is missing.

        Copies that fail verification are passed over for an intact one; when every
        copy is damaged, raises the first one's :class:`RecordingDamagedError`.
        """
        covering = self.index.covering(sequence_key(token_ids), start, end, sampled)
        if isinstance(covering, str):
            return covering + (self._damage_note() if covering == NOT_RECORDED else "")
        first: RecordingDamagedError | None = None
        tokens = np.frombuffer(token_ids, dtype="<i4")
        for c in covering:
            try:
                row_tokens, arrays = self.row(c.row)
            except RecordingDamagedError as e:
                first = first or e
                continue
            if np.array_equal(row_tokens, tokens):
                return arrays
        if first is not None:
            raise first
        return NOT_RECORDED + self._damage_note()

    def _damage_note(self) -> str:
        if not self.damaged and not self.skipped:
            return ""
        return f" (the recording has unreadable parts: {self.skipped[0]})"

    def close(self) -> None:
        self._chunks.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
