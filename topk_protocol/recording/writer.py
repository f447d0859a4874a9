"""Write a recording: scored sequences appended as Arrow record batches, crash-safe.

Rows are buffered and written as one record batch every ``flush_interval_s`` seconds, or
as soon as ``flush_bytes`` of arrays are buffered (a background thread flushes), so a
killed writer loses at most that interval's rows and holds a bounded amount whatever the
teacher's speed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol import (
    RequestOptions,
    decode_sequence,
    dtype_from_name,
    dtype_name,
    pb,
    request_spans,
    teacher_temperature,
)
from topk_protocol._closeable import Closeable
from topk_protocol.arrays import SequenceArrays
from topk_protocol.errors import RecordingError
from topk_protocol.fingerprint import answer_problems
from topk_protocol.packing import Packing
from topk_protocol.recording.columns import StoredRow, record_batch, stored_row
from topk_protocol.recording.format import (
    COMPRESSIONS,
    DEFAULT_FLUSH_BYTES,
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_OBJECT_FLUSH_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    can_serve_dtype,
    cast_arrays,
    next_shard_number,
    packing_metadata,
    recording_schema,
    sequence_key,
    shard_name,
    shards,
    teacher_info_json,
    write_json_atomic,
)
from topk_protocol.recording.index import RowIndex
from topk_protocol.recording.reader import RecordingReader
from topk_protocol.storage import Location, StorageError, location

__all__ = ["RecordingWriter"]

log = logging.getLogger(__name__)


class RecordingWriter(Closeable):
    """Appends scored sequences to a recording directory (created, or resumed).

    Args:
        path: the directory: a local path, or a URI of any filesystem pyarrow knows
            (``s3://bucket/prefix``; :mod:`topk_protocol.storage`). When it holds a
            recording already, new rows go to a new shard and the teacher (vocabulary,
            tokenizer), K and dtype must match it.
        info: the teacher's ``TeacherInfo`` message (stored in ``metadata.json``).
        top_k, dtype: what the recording stores; ``None`` takes them from the first
            request written. Later requests may ask for more K or a more precise dtype
            (the rows are cut / cast exactly as the teacher casts); less raises.
        encoding, logprob_bits: ``"packed"`` stores each row's packed payload bytes
            (``logprob_bits`` per code, default 8); ``None`` takes them from the first
            request written. A packed recording takes packed answers of its K, dtype and
            bits, and float32 answers of at least its K (packed as the teacher packs).
        flush_interval_s: longest time a written row stays in memory only. On a local
            disk each flush appends a record batch to this session's shard; on any other
            filesystem (an object store) each flush writes and commits one whole shard
            object, since an object becomes visible, whole, only when its upload ends.
        flush_bytes: a flush is due as soon as the buffered rows hold this many bytes, so
            memory does not grow with the teacher's speed. Default: 4 MiB on a local disk
            (``DEFAULT_FLUSH_BYTES``), 64 MiB on an object store
            (``DEFAULT_OBJECT_FLUSH_BYTES``: each flush is one object there).
        compression: Arrow IPC buffer codec, ``"zstd"`` (``"auto"``), ``"lz4"`` or
            ``"none"`` (shards are then memory-mapped when read: no decompression).
        metadata: extra JSON-serializable entries for ``metadata.json``.

    Thread-safe; :meth:`add` does not wait for a flush's compression and write (the
    flush takes the buffered rows and builds their batch outside the rows' lock). A
    sequence whose positions (and sampled log-probs) are covered by a
    recorded row is not written again; one with candidate ids is written unless this
    writer wrote the same positions with the same candidate ids already (the candidates
    change from request to request, e.g. the student's own top ids).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        info: pb.TeacherInfo,
        *,
        top_k: int | None = None,
        dtype: str | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        flush_bytes: int | None = None,
        compression: str = "zstd",
        metadata: dict[str, Any] | None = None,
        encoding: str | None = None,
        logprob_bits: int | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: {compression!r}; use one of {COMPRESSIONS}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s: must be > 0, got {flush_interval_s}")
        if flush_bytes is not None and not flush_bytes > 0:
            raise ValueError(f"flush_bytes: must be > 0, got {flush_bytes}")
        if dtype is not None:
            dtype = dtype_name(dtype_from_name(dtype))
        #: The directory as given: a ``Path``, or the URI string.
        self.path: str | Path = location(path)
        self._root = Location.of(path)
        if flush_bytes is None:
            local = self._root.local
            flush_bytes = DEFAULT_FLUSH_BYTES if local else DEFAULT_OBJECT_FLUSH_BYTES
        self.flush_bytes = int(flush_bytes)
        self.info = info
        self.compression = "zstd" if compression == "auto" else compression
        self.flush_interval_s = float(flush_interval_s)
        self._extra = dict(metadata or {})
        #: Guards the buffer, the index and the format; held briefly.
        self._lock = threading.RLock()
        #: One flush at a time, in order: the shard's stream and file are its own.
        self._flush_lock = threading.Lock()
        self._closed = False
        #: The rows added since the last flush, as they will be stored.
        self._buffer: list[StoredRow] = []
        self._buffered_bytes = 0
        self._file: Any = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._shard: Location | None = None
        self._next_shard: int | None = None  # the next shard's number
        #: Every row recorded, the resumed ones included.
        self.index = RowIndex()
        #: (key, start, end, candidate id bytes) of the rows with candidates written here.
        self._candidate_rows: set[tuple[bytes, int, int, bytes]] = set()
        self.rows_written = 0
        self.top_k: int | None = top_k
        self.dtype: str | None = dtype
        #: The recorded request options (``RequestOptions.recorded``); None: not fixed yet.
        self.options: dict[str, Any] | None = None
        #: A packed recording's packing (None: the default encoding); fixed by the
        #: constructor's ``encoding``, a resumed recording or the first row.
        self.packing: Packing | None = None
        self._packing_fixed = encoding is not None
        if encoding is not None:
            opts = RequestOptions(1, encoding=encoding, logprob_bits=logprob_bits)
            self.packing = opts.packing(int(info.vocab_size))
        try:
            self._root.make_dir()
            self._has_metadata = self._root.child(METADATA_FILE).is_file()
        except StorageError as e:
            raise RecordingError(self._root, None, f"cannot write there: {e}") from None
        if self._has_metadata:
            self._resume()
        elif self.top_k is not None and self.dtype is not None:
            self._write_metadata()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: a flush is due (flush_bytes buffered, or close)
        self._thread = threading.Thread(target=self._flusher, daemon=True, name="recording-flush")
        self._thread.start()

    # -- metadata ----------------------------------------------------------------------
    def _resume(self) -> None:
        with RecordingReader(self._root) as r:
            problems = []
            for field in ("vocab_size", "tokenizer_fingerprint"):
                old, new = getattr(r.info, field), getattr(self.info, field)
                if old != new:
                    problems.append(f"{field}: recorded {old!r}, this teacher has {new!r}")
            problems += answer_problems(self.info, r.info)
            if r.temperature != teacher_temperature(self.info):
                problems.append(
                    f"temperature: recorded {r.temperature!r}, this teacher has "
                    f"{teacher_temperature(self.info)!r}"
                )
            for name, mine, theirs in (
                ("top_k", self.top_k, r.top_k),
                ("dtype", self.dtype, r.dtype),
            ):
                if mine is not None and mine != theirs:
                    problems.append(f"{name}: recorded {theirs!r}, asked {mine!r}")
            if self._packing_fixed and self.packing != r.packing:
                problems.append(f"packing: recorded {r.packing!r}, asked {self.packing!r}")
            if problems:
                raise RecordingError(self._root, None, "cannot append: " + "; ".join(problems))
            self.top_k, self.dtype, self.options = r.top_k, r.dtype, r.options
            self.packing, self._packing_fixed = r.packing, True
            self.index = r.index

    def _write_metadata(self) -> None:
        assert self.top_k is not None and self.dtype is not None
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "teacher": teacher_info_json(self.info),
            "model_name": self.info.model_name,
            "vocab_size": int(self.info.vocab_size),
            "tokenizer_fingerprint": self.info.tokenizer_fingerprint,
            "schema_version": int(self.info.schema_version),
            "temperature": teacher_temperature(self.info),
            "top_k": int(self.top_k),
            "dtype": self.dtype,
            "options": self.options or RequestOptions.recorded_defaults(),
            "compression": self.compression,
            "extra": self._extra,
            **packing_metadata(self.packing),
        }
        write_json_atomic(self._root.child(METADATA_FILE), meta)
        self._has_metadata = True

    # -- writing -----------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows recorded (this session's and the resumed ones)."""
        return len(self.index)

    def covers(self, token_ids: bytes, start: int, end: int, sampled: bool) -> bool:
        """Whether a recorded row holds positions ``[start, end)`` of this sequence (and
        its sampled log-probs when ``sampled``)."""
        return not isinstance(
            self.index.covering(sequence_key(token_ids), start, end, sampled), str
        )

    def _fix_format(self, top_k: int, dtype: str, packing: Packing | None) -> None:
        if self.top_k is None:
            self.top_k = top_k
        if self.dtype is None:
            self.dtype = dtype
        if not self._packing_fixed:
            self.packing, self._packing_fixed = packing, True
        if not self._has_metadata:
            self._write_metadata()
        problem = self._format_problem(top_k, dtype, packing)
        if problem is not None:
            raise RecordingError(self._root, None, problem)

    def _format_problem(self, top_k: int, dtype: str, packing: Packing | None) -> str | None:
        """Why an answer of (``top_k``, ``dtype``, ``packing``) cannot give this recording's
        values exactly (None: it can)."""
        if self.packing is None and packing is not None:
            return "encoding: a packed answer cannot give the recorded default-encoding values"
        if self.packing is not None:
            same = packing == self.packing and dtype == self.dtype and top_k == self.top_k
            if same or (packing is None and dtype == "float32" and top_k >= (self.top_k or 0)):
                return None
            how = f"packed at {packing.logprob_bits} bits" if packing else "unpacked"
            return (
                f"encoding: the recording packs K {self.top_k} {self.dtype} at "
                f"{self.packing.logprob_bits} bits; an answer of K {top_k} {dtype} {how} "
                "cannot give its bytes exactly (it takes the same packing, or float32 values)"
            )
        if top_k < (self.top_k or 0):
            return f"top_k: {top_k} is less than the recorded {self.top_k}"
        if self.dtype is not None and not can_serve_dtype(dtype, self.dtype):
            return f"dtype: {dtype} log-probs cannot give the recorded {self.dtype} exactly"
        return None

    def check_request(self, options: RequestOptions) -> None:
        """Before a request is sent: RecordingError naming the option when its answer
        could not be recorded here (a recording holds the K, dtype, encoding and sampling
        options of its first request; ``docs/datasets.md``)."""
        with self._lock:
            if self.top_k is None or self.dtype is None:
                return
            recorded = options.recorded()
            if self.options is not None and recorded != self.options:
                raise RecordingError(
                    self._root, None, f"options: recorded {self.options}, this request {recorded}"
                )
            packing = options.packing(int(self.info.vocab_size))
            problem = self._format_problem(options.top_k, options.dtype, packing)
        if problem is not None:
            raise RecordingError(self._root, None, problem)

    def add(
        self,
        token_ids: npt.ArrayLike,
        arrays: SequenceArrays,
        *,
        dtype: str,
        packing: Packing | None = None,
    ) -> bool:
        """Record one scored sequence: ``token_ids`` ``[L]`` and the ``arrays`` of its
        positions ``[arrays.position_start, arrays.position_end)``; ``dtype`` is what the
        values came as (float32 values of a ``dtype`` answer), ``packing`` how (None:
        unpacked). False when already covered."""
        tok = np.ascontiguousarray(token_ids, dtype="<i4")
        start, end = arrays.position_start, arrays.position_end
        if not end <= len(tok):
            raise ValueError(f"positions: [{start}, {end}) is outside the {len(tok)} tokens")
        with self._lock:
            if self._closed:
                raise RecordingError(self._root, None, "the writer is closed")
            self._fix_format(arrays.top_k, dtype, packing)
            assert self.top_k is not None and self.dtype is not None
            key = sequence_key(tok.tobytes())
            has_sampled = arrays.sampled_logprobs is not None
            if arrays.candidate_ids is None:
                if self.covers(tok.tobytes(), start, end, has_sampled):
                    return False
            else:
                seen = (key, start, end, np.ascontiguousarray(arrays.candidate_ids).tobytes())
                if seen in self._candidate_rows:
                    return False
                self._candidate_rows.add(seen)
            top = arrays.top(self.top_k)
            cast = cast_arrays(top, self.dtype)
            if self.packing is not None:  # packing quantizes the float32 values itself
                cast = replace(cast, logprobs=top.logprobs)
            row = stored_row(key, tok, cast, self.dtype, self.packing)
            self._buffer.append(row)
            self._buffered_bytes += row.nbytes
            self.index.add(key, start, end, has_sampled)
            if self._buffered_bytes >= self.flush_bytes:
                self._wake.set()
        return True

    def _fix_options(self, recorded: dict[str, Any]) -> None:
        """The first request fixes the recorded options; a later one must ask the same."""
        with self._lock:
            if self.options is None:
                self.options = recorded
                if self._has_metadata:
                    self._write_metadata()
            elif recorded != self.options:
                raise RecordingError(
                    self._root, None, f"options: recorded {self.options}, this request {recorded}"
                )

    def write(
        self,
        request: pb.ScoreRequest,
        response: pb.ScoreResponse,
        options: RequestOptions | None = None,
    ) -> int:
        """Record every sequence of an answered request (``response`` complete, one
        ``SequencePayload`` per sequence, e.g. ``ResponseAssembler.merged_response``;
        ``options`` default: the request's), decoded here: see :meth:`write_sequences`."""
        by_index = {int(p.sequence_index): p for p in response.sequences}
        spans = request_spans(request)
        sequences = []
        for i, (seq, (start, end)) in enumerate(zip(request.sequences, spans, strict=True)):
            if i not in by_index:
                raise ValueError(f"response: sequence {i} is missing")
            raw, c = seq.candidate_ids, int(seq.num_candidates)
            cand = np.frombuffer(raw, dtype="<i4").reshape(end - start, c) if c else None
            sequences.append(decode_sequence(by_index[i], cand) if start != end else None)
        return self.write_sequences(
            request, sequences, RequestOptions.from_proto(request) if options is None else options
        )

    def write_sequences(
        self,
        request: pb.ScoreRequest,
        sequences: Sequence[SequenceArrays | None],
        options: RequestOptions,
    ) -> int:
        """Record the decoded answer of a request: ``sequences[i]`` the rows of its
        sequence ``i`` (None: an empty range), ``options`` the ones the request was built
        with (the client hands on what it asked; nothing is re-derived from the message).
        Returns the number of rows written (covered sequences are skipped)."""
        self._fix_options(options.recorded())
        packing = options.packing(int(self.info.vocab_size))
        n = 0
        for seq, arrays in zip(request.sequences, sequences, strict=True):
            if arrays is None or not arrays.num_positions:
                continue  # an empty range: nothing to record
            if not options.include_sampled:
                arrays = replace(arrays, sampled_logprobs=None)
            tokens = np.frombuffer(seq.token_ids, dtype="<i4")
            n += self.add(tokens, arrays, dtype=options.dtype, packing=packing)
        return n

    def _flusher(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception:  # pragma: no cover - surfaced again by close()
                log.exception("recording %s: background flush failed", self.path)

    def flush(self) -> None:
        """Write the buffered rows as one record batch and hand it to the OS (a local
        disk), or commit them as one shard object (any other filesystem). When writing
        fails, the rows stay buffered for the next flush and the error is raised."""
        with self._flush_lock:
            with self._lock:
                rows, self._buffer = self._buffer, []
                held, self._buffered_bytes = self._buffered_bytes, 0
            if not rows:
                return
            try:
                self._write_rows(rows)
            except BaseException:
                with self._lock:  # back in front of the rows added meanwhile, to retry
                    self._buffer[:0] = rows
                    self._buffered_bytes += held
                raise

    def _write_rows(self, rows: list[StoredRow]) -> None:
        """Write ``rows`` as one record batch (the caller holds the flush lock)."""
        assert self.top_k is not None and self.dtype is not None
        schema = recording_schema(self.top_k, self.dtype, self._format(), packing=self.packing)
        if self._stream is None:
            self._open_shard(schema)
        batch = record_batch(rows, schema, self.top_k, self.dtype, self.packing)
        assert self._stream is not None and self._shard is not None
        try:
            self._stream.write_batch(batch)
            if self._shard.local:
                self._file.flush()
            else:
                self._end_shard()
        except (OSError, pa.ArrowException) as e:
            if not self._shard.local:
                self._drop_shard()
            raise RecordingError(
                self._shard, None, f"writing {batch.num_rows} rows failed (kept to retry): {e}"
            ) from None
        self.rows_written += batch.num_rows

    def _format(self) -> dict[str, Any]:
        """The format fields (besides K and dtype) every shard's schema repeats."""
        return {
            "vocab_size": int(self.info.vocab_size),
            "tokenizer_fingerprint": self.info.tokenizer_fingerprint,
            "temperature": teacher_temperature(self.info),
        }

    def _open_shard(self, schema: pa.Schema) -> None:
        if self._next_shard is None:
            self._next_shard = next_shard_number(shards(self._root))
        self._shard = self._root.child(shard_name(self._next_shard))
        self._next_shard += 1
        if self._shard.local:
            self._file = open(self._shard.path, "xb")  # noqa: SIM115 - closed in close()
        else:
            # The whole object is built in memory (one flush's rows) and uploaded in one
            # go: an upload that fails publishes nothing (an abandoned pyarrow S3 stream
            # would complete its upload, with what it had, when collected).
            self._file = pa.BufferOutputStream()
        codec = None if self.compression == "none" else self.compression
        self._stream = pa.ipc.new_stream(
            self._file, schema, options=pa.ipc.IpcWriteOptions(compression=codec)
        )

    def _end_shard(self) -> None:
        """End the shard's stream and close it: a local file is synced to disk; an
        object store's upload completes, which publishes the object whole."""
        assert self._stream is not None and self._shard is not None
        self._stream.close()
        if self._shard.local:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        else:
            self._shard.write_bytes_atomic(self._file.getvalue())
        self._stream = None

    def _drop_shard(self) -> None:
        """Give up a shard whose upload failed (never published: nothing to remove)."""
        self._stream = None
        self._file = None

    def close(self) -> None:
        """Flush, end the stream and sync the shard to disk (or commit its object)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self.flush()
        with self._flush_lock:
            if self._stream is not None:
                self._end_shard()
