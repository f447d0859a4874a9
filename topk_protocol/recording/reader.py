"""Read a recording: every complete record batch of every shard, each row verified.

Integrity (:mod:`topk_protocol.recording.integrity`): a row is verified each time it is read; a row
that fails, a batch or shard that does not parse, a shard whose schema disagrees with
``metadata.json`` is reported as a :class:`~topk_protocol.errors.RecordingDamagedError`
naming the shard (or ``metadata.json``) and the row, and the intact rows still replay.
Shards written before checksums (no ``row_crc32`` column) still open, with one warning.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol import RequestOptions
from topk_protocol._closeable import Closeable
from topk_protocol.arrays import SequenceArrays
from topk_protocol.errors import RecordingDamagedError, RecordingError
from topk_protocol.packing import Packing
from topk_protocol.recording.chunks import Chunk, Slot, Tally
from topk_protocol.recording.format import (
    METADATA_FILE,
    READ_ERRORS,
    check_schema,
    read_metadata,
    recording_packing,
    sequence_key,
    shards,
)
from topk_protocol.recording.index import NOT_RECORDED, RowIndex
from topk_protocol.storage import Location, StorageError, location

__all__ = ["INDEX_READ_BUFFER_BYTES", "REMOTE_CACHED_BATCHES", "RecordingReader"]

log = logging.getLogger(__name__)

#: Decoded record batches a reader of a non-local recording keeps (each fetched by its
#: byte range when one of its rows is read; the least recently used one goes first):
#: its memory is this many batches, whatever the recording's size.
REMOTE_CACHED_BATCHES = 4
#: Read-ahead of the pass that indexes a non-local shard when a reader opens it.
INDEX_READ_BUFFER_BYTES = 1 << 20


class RecordingReader(Closeable):
    """Reads a recording directory: every complete record batch of every shard.

    Attributes:
        path: the directory as given (a ``Path``, or the URI string).
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

    ``path`` is a local directory or a URI of any filesystem pyarrow knows
    (``s3://bucket/prefix``; :mod:`topk_protocol.storage`). Raises
    :class:`RecordingError` naming ``metadata.json`` when it is not a recording's (or
    naming the location when the store cannot be reached), and
    :class:`RecordingDamagedError` naming it when it disagrees with every shard's schema
    (K, dtype, vocabulary, tokenizer, temperature).

    Local shards: uncompressed ones are memory-mapped (rows are views); compressed ones
    are decompressed into memory when opened. Any other filesystem streams: opening
    reads each shard once, sequentially, keeping only the index columns (one batch in
    memory at a time); reading a row fetches its batch's byte range, and the reader
    keeps the last :data:`REMOTE_CACHED_BATCHES` decoded batches. Thread-safe for
    reads; works after ``fork`` (files are reopened in the child).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path: str | Path = location(path)
        self._root = Location.of(path)
        self.metadata, self.info = read_metadata(self._root)
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
        self._slots: list[Slot] = []
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Chunk] = OrderedDict()
        self._files: dict[str, Any] = {}
        self._pid = os.getpid()
        disagreeing: list[tuple[Location, tuple[str, ...]]] = []
        agreeing = 0
        try:
            found = shards(self._root)
        except StorageError as e:
            raise RecordingError(self._root, None, f"cannot list its shards: {e}") from None
        for shard, size in found:
            if size == 0:
                self.skipped.append(f"recording {self.path}: {shard.name} is empty (0 bytes)")
                continue
            source, stream = self._open_shard(shard)
            try:
                agreeing += self._add_shard(shard, size, source, stream, disagreeing)
            finally:
                if not shard.local:
                    source.close()
        if disagreeing and not agreeing:
            # Every shard says otherwise: it is metadata.json that is wrong.
            shard, what = disagreeing[0]
            raise RecordingDamagedError(
                self._root.child(METADATA_FILE),
                None,
                f"disagrees with every shard's schema ({len(disagreeing)}), e.g. "
                f"{shard.name}: " + "; ".join(what),
            )
        for shard, what in disagreeing:
            self._damage(shard, None, f"{'; '.join(what)}; none of its rows are served")
        self._chunk_start = np.cumsum([0] + [s.num_rows for s in self._slots])
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

    @property
    def _packed(self) -> tuple[str, Packing] | None:
        """A packed recording's ``(dtype, packing)`` its chunks decode with."""
        return None if self.packing is None else (self.dtype, self.packing)

    def _add_shard(
        self,
        shard: Location,
        size: int,
        source: Any,
        stream: pa.ipc.RecordBatchStreamReader | None,
        disagreeing: list[tuple[Location, tuple[str, ...]]],
    ) -> bool:
        """Index the shard's rows; False when none are served (its schema is damaged, or
        disagrees with ``metadata.json``: then it joins ``disagreeing``)."""
        if stream is None:
            return False
        check = check_schema(stream.schema, self.metadata)
        if check.damage is not None:
            self._damage(shard, None, f"{check.damage}; none of its rows are served")
            return False
        if check.disagrees:
            disagreeing.append((shard, check.disagrees))
            return False
        if not check.checksums:
            self.unverified.append(shard.name)
        tell = source.tell if shard.local else lambda: source.position
        for slot, chunk in self._read_batches(shard, size, tell, stream):
            self._slots.append(slot)
            self.index.extend(
                chunk.keys, chunk.starts.tolist(), chunk.ends.tolist(), chunk.has_sampled.tolist()
            )
        return True

    def _damage(self, shard: Location, row: int | None, message: str) -> None:
        err = RecordingDamagedError(shard, row, message)
        self.damaged.append(err)
        self.skipped.append(str(err))

    def _open_shard(self, shard: Location) -> tuple[Any, pa.ipc.RecordBatchStreamReader | None]:
        """The shard's source (a memory map, or a stream read ahead) and its IPC stream."""
        try:
            if shard.local:
                source: Any = pa.memory_map(shard.path)
                self._maps.append(source)
                native = source
            else:
                source = Tally(shard.open_input_stream(INDEX_READ_BUFFER_BYTES))
                native = pa.PythonFile(source, mode="r")
        except OSError as e:
            raise RecordingError(shard, None, f"cannot open it: {e}") from None
        try:
            return source, pa.ipc.open_stream(native)
        except READ_ERRORS as e:
            self._damage(shard, None, f"no readable schema ({e}); none of its rows are served")
            return source, None

    def _read_batches(
        self, shard: Location, size: int, tell: Any, stream: pa.ipc.RecordBatchStreamReader
    ) -> Iterator[tuple[Slot, Chunk]]:
        """A slot and the decoded chunk of each of the shard's batches that parse and
        validate; a batch that does not validate is reported and passed over, one that
        does not parse ends the shard. ``tell()``: the byte offset reached in the shard."""
        n = rows = 0
        while True:
            offset = tell()
            try:
                batch = stream.read_next_batch()
            except StopIteration:
                return
            except READ_ERRORS as e:
                self.skipped.append(
                    f"recording {self.path}: {shard.name}: kept {n} complete batches; skipped "
                    f"the {size - offset} bytes after them (a batch cut short, e.g. by a "
                    f"killed writer, or damaged: {e})"
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
                chunk = Chunk(batch, self.top_k, shard, rows, self._packed)
                slot = Slot(
                    shard,
                    stream.schema,
                    rows,
                    chunk.num_rows,
                    int((chunk.ends - chunk.starts).sum()),
                    chunk if shard.local else None,
                    offset,
                    tell() - offset,
                )
                yield slot, chunk
            rows += batch.num_rows

    def _chunk(self, c: int) -> Chunk:
        """Batch ``c`` decoded: kept (a local shard), or fetched by byte range and kept
        among the last :data:`REMOTE_CACHED_BATCHES`."""
        slot = self._slots[c]
        if slot.chunk is not None:
            return slot.chunk
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's files are not ours
                self._files.clear()
                self._cache.clear()
                self._pid = os.getpid()
            chunk = self._cache.get(c)
            if chunk is not None:
                self._cache.move_to_end(c)
                return chunk
            chunk = Chunk(self._fetch(slot), self.top_k, slot.shard, slot.first_row, self._packed)
            self._cache[c] = chunk
            while len(self._cache) > REMOTE_CACHED_BATCHES:
                self._cache.popitem(last=False)
            return chunk

    def _fetch(self, slot: Slot) -> pa.RecordBatch:
        """A batch's message read by its byte range (one ranged read on an object store)."""
        where = f"rows {slot.first_row} to {slot.first_row + slot.num_rows - 1}"
        try:
            f = self._files.get(slot.shard.path)
            if f is None:
                f = self._files[slot.shard.path] = slot.shard.open_input_file()
            message = pa.ipc.read_message(f.read_at(slot.length, slot.offset))
            return pa.ipc.read_record_batch(message, slot.schema)
        except OSError as e:
            raise RecordingError(slot.shard, slot.offset, f"reading {where} failed: {e}") from None
        except READ_ERRORS as e:
            raise RecordingDamagedError(
                slot.shard, None, f"{where} no longer decode (the shard changed?): {e}"
            ) from None

    # -- access ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows (recorded sequences)."""
        return len(self.index)

    @property
    def num_positions(self) -> int:
        return int(sum(s.positions for s in self._slots))

    def row(self, i: int) -> tuple[npt.NDArray[np.int32], SequenceArrays]:
        """Row ``i`` (in shard order) as ``(token_ids [L] int32, arrays)``, verified
        (checksum, lengths, vocabulary); raises :class:`RecordingDamagedError` naming
        its shard and row when damaged."""
        if not 0 <= i < len(self.index):
            raise IndexError(f"row {i} of a recording with {len(self.index)} rows")
        c = int(np.searchsorted(self._chunk_start, i, side="right")) - 1
        return self._chunk(c).row(i - int(self._chunk_start[c]), self._vocab_size)

    def key(self, i: int) -> bytes:
        return self.index.key(i)

    def __iter__(self) -> Iterator[tuple[npt.NDArray[np.int32], SequenceArrays]]:
        """Every row, as :meth:`row` gives it."""
        for c in range(len(self._slots)):
            chunk = self._chunk(c)
            for r in range(chunk.num_rows):
                yield chunk.row(r, self._vocab_size)

    def verify(self) -> list[RecordingDamagedError]:
        """Read every row: the damage found when opening and in every row that fails."""
        found = list(self.damaged)
        for c in range(len(self._slots)):
            chunk = self._chunk(c)
            for r in range(chunk.num_rows):
                try:
                    chunk.row(r, self._vocab_size)
                except RecordingDamagedError as e:
                    found.append(e)
        return found

    def find(
        self,
        token_ids: bytes,
        start: int,
        end: int,
        sampled: bool,
        serves: Callable[[SequenceArrays], str | None] | None = None,
    ) -> SequenceArrays | str:
        """The recorded row holding positions ``[start, end)`` of this sequence (with
        sampled log-probs when ``sampled``, and that ``serves``: None when it does, else
        why not), whole, or a sentence saying what is missing.

        Copies that fail verification are passed over for an intact one; when every
        copy is damaged, raises the first one's :class:`RecordingDamagedError`.
        """
        covering = self.index.covering(sequence_key(token_ids), start, end, sampled)
        if isinstance(covering, str):
            return covering + (self._damage_note() if covering == NOT_RECORDED else "")
        first: RecordingDamagedError | None = None
        why: str | None = None
        tokens = np.frombuffer(token_ids, dtype="<i4")
        for c in covering:
            try:
                row_tokens, arrays = self.row(c.row)
            except RecordingDamagedError as e:
                first = first or e
                continue
            if not np.array_equal(row_tokens, tokens):
                continue
            why = None if serves is None else serves(arrays)
            if why is None:
                return arrays
        if why is not None:
            return why
        if first is not None:
            raise first
        return NOT_RECORDED + self._damage_note()

    def _damage_note(self) -> str:
        if not self.damaged and not self.skipped:
            return ""
        return f" (the recording has unreadable parts: {self.skipped[0]})"

    def close(self) -> None:
        self._slots.clear()
        self._cache.clear()
        for f in [*self._maps, *self._files.values()]:
            f.close()
        self._maps.clear()
        self._files.clear()
