"""Recordings: a teacher's payloads as a directory of Apache Arrow IPC stream files.

A recording (also a *payload dataset*) is a directory::

    DIR/metadata.json          teacher info, temperature, recorded K and dtype, format version
    DIR/shard-<n>-<id>.arrow   Arrow IPC *stream* files, one per writer session

with one row per scored sequence:

============================  =========================================  ==================
column                        Arrow type                                 meaning
============================  =========================================  ==================
``key``                       ``binary`` (32 bytes)                      :func:`sequence_key`
``token_ids``                 ``list<int32>``                            ``[L]`` the sequence
``position_start``            ``int32``                                  first position
``position_end``              ``int32``                                  end (exclusive)
``ids``                       ``list<fixed_size_list<int32, K>>``        ``[S, K]`` top-k ids
``logprobs``                  ``list<fixed_size_list<F, K>>``            ``[S, K]`` sorted desc.
``sampled_logprobs``          ``list<F>``, null when not recorded        ``[S]``, NaN at L-1
============================  =========================================  ==================

``S = position_end - position_start``; row ``j`` is position ``position_start + j``. ``F``
is ``float16`` for a float16 recording and ``float32`` for float32 and bfloat16 ones
(bfloat16 values widened to float32, which is exact). Plain ``pyarrow`` and the Hugging
Face ``datasets`` library read these files without this project (see ``docs/datasets.md``).

Why Arrow IPC streams (measured in ``benchmarks/bench_datasets.py``): with zstd buffer
compression they are half the wire's size (15% more than Parquet with zstd) and read
about as fast, uncompressed ones are memory-mapped without any decoding, and a stream is
readable up to its last complete batch, so a writer killed at any moment leaves a
readable file (a Parquet file without its footer is unreadable). Compression uses
Arrow's built-in codecs (zstd, lz4), so a student-only install reads and writes them.

Crash safety: the writer buffers rows and writes them as one record batch every
``flush_interval_s`` seconds (a background thread flushes even when no new row comes), so
a killed writer loses at most that interval's rows. The reader keeps every complete batch
and lists what it skipped in :attr:`RecordingReader.skipped`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from google.protobuf import json_format

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
from topk_protocol.codec import _bf16_bits_to_f32, _f32_to_bf16_bits
from topk_protocol.errors import RecordingError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "RecordedSequence",
    "RecordingReader",
    "RecordingWriter",
    "can_serve_dtype",
    "cast_like_teacher",
    "recording_schema",
    "sequence_key",
]

log = logging.getLogger(__name__)

FORMAT_NAME = "topk-distill-payloads"
FORMAT_VERSION = 2  # 1 was the single-file ``.tkrec`` container
METADATA_FILE = "metadata.json"
SHARD_SUFFIX = ".arrow"
DEFAULT_FLUSH_INTERVAL_S = 2.0
COMPRESSIONS = ("zstd", "lz4", "none", "auto")  # auto: zstd
_KEY_DOMAIN = b"topk-distill/sequence/v2"


def sequence_key(token_ids: bytes | npt.ArrayLike) -> bytes:
    """The key of a recorded sequence: sha256 of its int32 little-endian token ids (32 bytes).

    Only the tokens count: K, positions and dtype are columns of the row, so one recorded
    row answers every K' <= K, position sub-range and reproducible dtype.
    """
    if not isinstance(token_ids, bytes | bytearray | memoryview):
        token_ids = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    return hashlib.sha256(_KEY_DOMAIN + bytes(token_ids)).digest()


def can_serve_dtype(recorded: str, wanted: str) -> bool:
    """Whether values recorded in ``recorded`` give exactly what the teacher sends in
    ``wanted``: the teacher computes float32 and casts once, so a float32 recording serves
    every dtype; a float16 or bfloat16 one only itself."""
    return recorded == "float32" or recorded == wanted


def _storage_type(dtype: str) -> pa.DataType:
    return pa.float16() if dtype == "float16" else pa.float32()


def recording_schema(top_k: int, dtype: str) -> pa.Schema:
    """The Arrow schema of a recording with ``top_k`` and log-prob ``dtype`` (name)."""
    f = _storage_type(dtype)
    return pa.schema(
        [
            pa.field("key", pa.binary(), nullable=False),
            pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("position_start", pa.int32(), nullable=False),
            pa.field("position_end", pa.int32(), nullable=False),
            pa.field("ids", pa.list_(pa.list_(pa.int32(), top_k)), nullable=False),
            pa.field("logprobs", pa.list_(pa.list_(f, top_k)), nullable=False),
            pa.field("sampled_logprobs", pa.list_(f)),
        ],
        metadata={"topk_distill": json.dumps({"top_k": top_k, "dtype": dtype})},
    )


def cast_like_teacher(values: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[Any]:
    """float32 -> the teacher's cast to ``dtype`` (the wire codec's: float16 with numpy's
    round-to-nearest-even; bfloat16 rounded to nearest even, returned widened to float32
    exactly), which is also what a ``dtype`` recording stores."""
    if dtype == "float32":
        return np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(values, dtype=np.float32).astype(np.float16)
    return _bf16_bits_to_f32(_f32_to_bf16_bits(np.asarray(values, dtype=np.float32)))


@dataclass(frozen=True)
class RecordedSequence:
    """One recorded row as numpy arrays (views of the Arrow buffers where possible).

    ``ids`` ``[S, K]`` int32; ``logprobs`` ``[S, K]`` and ``sampled_logprobs`` ``[S]`` (or
    ``None``) in the storage dtype (float16, or float32); positions ``[start, end)``.
    """

    token_ids: npt.NDArray[np.int32]
    ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[Any]
    sampled_logprobs: npt.NDArray[Any] | None
    start: int
    end: int


def _list_column(rows: list[npt.NDArray[Any]], typ: pa.DataType, width: int = 0) -> pa.Array:
    """``[n_i]`` (or ``[n_i, width]``) arrays -> ``list<typ>`` (or ``list<fixed_size_list>``)."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = np.concatenate([r.reshape(-1) for r in rows]) if rows else np.zeros(0)
    values = pa.array(flat, type=typ)
    if width:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(offsets, values)


def _sampled_column(rows: list[npt.NDArray[Any] | None], typ: pa.DataType) -> pa.Array:
    present = [r if r is not None else np.zeros(0, typ.to_pandas_dtype()) for r in rows]
    lengths = np.array([len(r) for r in present], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = np.concatenate(present) if present else np.zeros(0)
    mask = pa.array([r is None for r in rows], type=pa.bool_())
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=typ), mask=mask)


def _read_metadata(root: Path) -> dict[str, Any]:
    path = root / METADATA_FILE
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordingError(root, None, f"no {METADATA_FILE}: not a recording") from None
    except (OSError, ValueError) as e:
        raise RecordingError(path, None, f"unreadable: {e}") from None
    if meta.get("format") != FORMAT_NAME:
        raise RecordingError(path, None, f"format {meta.get('format')!r}, not {FORMAT_NAME!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise RecordingError(
            path,
            None,
            f"format_version {meta.get('format_version')}; this reader reads {FORMAT_VERSION}",
        )
    return meta


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _shards(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"*{SHARD_SUFFIX}") if p.is_file())


class RecordingWriter(Closeable):
    """Appends scored sequences to a recording directory (created, or resumed).

    Args:
        path: the directory. When it holds a recording already, new rows go to a new shard
            and the teacher (vocabulary, tokenizer), K and dtype must match it.
        info: the teacher's ``TeacherInfo`` message (stored in ``metadata.json``).
        top_k, dtype: what the recording stores; ``None`` takes them from the first
            request written. Later requests may ask for more K or a more precise dtype
            (the rows are cut / cast exactly as the teacher casts); less raises.
        flush_interval_s: longest time a written row stays in memory only.
        compression: Arrow IPC buffer codec, ``"zstd"`` (``"auto"``), ``"lz4"`` or
            ``"none"`` (shards are then memory-mapped when read: no decompression).
        metadata: extra JSON-serializable entries for ``metadata.json``.

    Thread-safe. A sequence whose positions (and sampled log-probs) are covered by a
    recorded row is not written again.
    """

    def __init__(
        self,
        path: str | Path,
        info: pb.TeacherInfo,
        *,
        top_k: int | None = None,
        dtype: str | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        compression: str = "zstd",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: {compression!r}; use one of {COMPRESSIONS}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s: must be > 0, got {flush_interval_s}")
        if dtype is not None:
            dtype = dtype_name(dtype_from_name(dtype))
        self.path = Path(path)
        self.info = info
        self.compression = "zstd" if compression == "auto" else compression
        self.flush_interval_s = float(flush_interval_s)
        self._extra = dict(metadata or {})
        self._lock = threading.RLock()
        self._closed = False
        self._buffer: list[tuple[bytes, RecordedSequence]] = []
        self._file: Any = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._shard: Path | None = None
        # key -> [(start, end, has_sampled)] of every row recorded (resumed ones included)
        self._copies: dict[bytes, list[tuple[int, int, bool]]] = {}
        self.rows_written = 0
        self.top_k: int | None = top_k
        self.dtype: str | None = dtype
        #: The recorded request options (``RequestOptions.recorded``); None: not fixed yet.
        self.options: dict[str, Any] | None = None
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / METADATA_FILE).exists():
            self._resume()
        elif self.top_k is not None and self.dtype is not None:
            self._write_metadata()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flusher, daemon=True, name="recording-flush")
        self._thread.start()

    # -- metadata ----------------------------------------------------------------------
    def _resume(self) -> None:
        with RecordingReader(self.path) as r:
            problems = []
            for field in ("vocab_size", "tokenizer_fingerprint"):
                old, new = getattr(r.info, field), getattr(self.info, field)
                if old != new:
                    problems.append(f"{field}: recorded {old!r}, this teacher has {new!r}")
            for name, mine, theirs in (
                ("top_k", self.top_k, r.top_k),
                ("dtype", self.dtype, r.dtype),
            ):
                if mine is not None and mine != theirs:
                    problems.append(f"{name}: recorded {theirs!r}, asked {mine!r}")
            if problems:
                raise RecordingError(self.path, None, "cannot append: " + "; ".join(problems))
            self.top_k, self.dtype, self.options = r.top_k, r.dtype, r.options
            for key, copies in r.copies().items():
                self._copies[key] = [(c.start, c.end, c.has_sampled) for c in copies]

    def _write_metadata(self) -> None:
        assert self.top_k is not None and self.dtype is not None
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "teacher": json_format.MessageToDict(self.info, preserving_proto_field_name=True),
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
        }
        _write_json_atomic(self.path / METADATA_FILE, meta)

    # -- writing -----------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows recorded (this session's and the resumed ones)."""
        return sum(len(c) for c in self._copies.values())

    def covers(self, token_ids: bytes, start: int, end: int, sampled: bool) -> bool:
        """Whether a recorded row holds positions ``[start, end)`` of this sequence (and
        its sampled log-probs when ``sampled``)."""
        for s, e, has in self._copies.get(sequence_key(token_ids), ()):
            if s <= start and end <= e and (has or not sampled):
                return True
        return False

    def _fix_format(self, top_k: int, dtype: str) -> None:
        if self.top_k is None:
            self.top_k = top_k
        if self.dtype is None:
            self.dtype = dtype
        if not (self.path / METADATA_FILE).exists():
            self._write_metadata()
        if top_k < self.top_k:
            raise RecordingError(
                self.path, None, f"top_k: {top_k} is less than the recorded {self.top_k}"
            )
        if not can_serve_dtype(dtype, self.dtype):
            raise RecordingError(
                self.path,
                None,
                f"dtype: {dtype} log-probs cannot give the recorded {self.dtype} exactly",
            )

    def add(
        self,
        token_ids: npt.ArrayLike,
        ids: npt.ArrayLike,
        logprobs: npt.ArrayLike,
        sampled_logprobs: npt.ArrayLike | None,
        *,
        start: int,
        dtype: str,
    ) -> bool:
        """Record one scored sequence: ``ids``/``logprobs`` ``[S, K]`` of positions
        ``[start, start + S)``, ``sampled_logprobs`` ``[S]`` or None; ``dtype`` is what the
        values came as (float32 values of a ``dtype`` answer). False when already covered."""
        tok = np.ascontiguousarray(token_ids, dtype="<i4")
        ids_a = np.asarray(ids, dtype=np.int32)
        if ids_a.ndim != 2:
            raise ValueError(f"ids: expected [S, K], got shape {ids_a.shape}")
        s, k = ids_a.shape
        end = start + s
        if not 0 <= start <= end <= len(tok):
            raise ValueError(f"positions: [{start}, {end}) is outside the {len(tok)} tokens")
        with self._lock:
            if self._closed:
                raise RecordingError(self.path, None, "the writer is closed")
            self._fix_format(k, dtype)
            assert self.top_k is not None and self.dtype is not None
            key = sequence_key(tok.tobytes())
            if self.covers(tok.tobytes(), start, end, sampled_logprobs is not None):
                return False
            kk = self.top_k
            lp = np.asarray(logprobs, dtype=np.float32)[:, :kk]
            sp = None if sampled_logprobs is None else np.asarray(sampled_logprobs, np.float32)
            row = RecordedSequence(
                token_ids=tok,
                ids=np.ascontiguousarray(ids_a[:, :kk]),
                logprobs=cast_like_teacher(np.ascontiguousarray(lp), self.dtype),
                sampled_logprobs=None if sp is None else cast_like_teacher(sp, self.dtype),
                start=start,
                end=end,
            )
            self._buffer.append((key, row))
            self._copies.setdefault(key, []).append((start, end, sp is not None))
        return True

    def _fix_options(self, recorded: dict[str, Any]) -> None:
        """The first request fixes the recorded options; a later one must ask the same."""
        with self._lock:
            if self.options is None:
                self.options = recorded
                if (self.path / METADATA_FILE).exists():
                    self._write_metadata()
            elif recorded != self.options:
                raise RecordingError(
                    self.path, None, f"options: recorded {self.options}, this request {recorded}"
                )

    def write(
        self,
        request: pb.ScoreRequest,
        response: pb.ScoreResponse,
        options: RequestOptions | None = None,
    ) -> int:
        """Record every sequence of an answered request (``response`` complete, e.g.
        :meth:`~student_client.payload.ResponseAssembler.merged_response`; ``options``
        default: the request's). Returns the number of rows written (covered sequences
        are skipped)."""
        options = RequestOptions.from_proto(request) if options is None else options
        self._fix_options(options.recorded())
        dtype, sampled = options.dtype, options.include_sampled
        spans = request_spans(request)
        by_index = {int(p.sequence_index): p for p in response.sequences}
        n = 0
        for i, (seq, (start, _)) in enumerate(zip(request.sequences, spans, strict=True)):
            if i not in by_index:
                raise ValueError(f"response: sequence {i} is missing")
            if start == spans[i][1]:
                continue  # an empty range: nothing to record
            dec = decode_sequence(by_index[i])
            tokens = np.frombuffer(seq.token_ids, dtype="<i4")
            sp = dec.sampled_logprobs if sampled else None
            n += self.add(tokens, dec.ids, dec.logprobs, sp, start=start, dtype=dtype)
        return n

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception:  # pragma: no cover - surfaced again by close()
                log.exception("recording %s: background flush failed", self.path)

    def flush(self) -> None:
        """Write the buffered rows as one record batch and hand it to the OS."""
        with self._lock:
            if not self._buffer:
                return
            assert self.top_k is not None and self.dtype is not None
            schema = recording_schema(self.top_k, self.dtype)
            if self._stream is None:
                self._open_shard(schema)
            rows = [r for _, r in self._buffer]
            f = _storage_type(self.dtype)
            batch = pa.record_batch(
                [
                    pa.array([k for k, _ in self._buffer], pa.binary()),
                    _list_column([r.token_ids for r in rows], pa.int32()),
                    pa.array([r.start for r in rows], pa.int32()),
                    pa.array([r.end for r in rows], pa.int32()),
                    _list_column([r.ids for r in rows], pa.int32(), self.top_k),
                    _list_column([r.logprobs for r in rows], f, self.top_k),
                    _sampled_column([r.sampled_logprobs for r in rows], f),
                ],
                schema=schema,
            )
            assert self._stream is not None
            self._stream.write_batch(batch)
            self._file.flush()
            self.rows_written += len(rows)
            self._buffer.clear()

    def _open_shard(self, schema: pa.Schema) -> None:
        n = len(_shards(self.path))
        self._shard = self.path / f"shard-{n:05d}-{uuid.uuid4().hex[:8]}{SHARD_SUFFIX}"
        self._file = open(self._shard, "xb")  # noqa: SIM115 - closed in close()
        codec = None if self.compression == "none" else self.compression
        self._stream = pa.ipc.new_stream(
            self._file, schema, options=pa.ipc.IpcWriteOptions(compression=codec)
        )

    def close(self) -> None:
        """Flush, end the stream and sync the shard to disk."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join()
        with self._lock:
            self.flush()
            if self._stream is not None:
                self._stream.close()
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._stream = None


@dataclass(frozen=True)
class _Copy:
    row: int
    start: int
    end: int
    has_sampled: bool


class _Chunk:
    """numpy views of one record batch's columns (no copy for uncompressed shards)."""

    def __init__(self, batch: pa.RecordBatch, top_k: int) -> None:
        self.num_rows = batch.num_rows
        self.starts = batch.column("position_start").to_numpy()
        self.ends = batch.column("position_end").to_numpy()
        tok = batch.column("token_ids")
        self.tok_offsets = tok.offsets.to_numpy()
        self.tok_values = tok.values.to_numpy()
        ids, lps = batch.column("ids"), batch.column("logprobs")
        self.row_offsets = ids.offsets.to_numpy()
        self.ids = ids.values.flatten().to_numpy().reshape(-1, top_k)
        self.lps = lps.values.flatten().to_numpy().reshape(-1, top_k)
        sp = batch.column("sampled_logprobs")
        self.has_sampled = sp.is_valid().to_numpy(zero_copy_only=False)
        self.sp_offsets = sp.offsets.to_numpy()
        self.sp_values = sp.values.to_numpy()

    def row(self, r: int) -> RecordedSequence:
        a, b = self.row_offsets[r], self.row_offsets[r + 1]
        sp = None
        if self.has_sampled[r]:
            sp = self.sp_values[self.sp_offsets[r] : self.sp_offsets[r + 1]]
        return RecordedSequence(
            token_ids=self.tok_values[self.tok_offsets[r] : self.tok_offsets[r + 1]],
            ids=self.ids[a:b],
            logprobs=self.lps[a:b],
            sampled_logprobs=sp,
            start=int(self.starts[r]),
            end=int(self.ends[r]),
        )


class RecordingReader(Closeable):
    """Reads a recording directory: every complete record batch of every shard.

    Attributes:
        info: the recorded teacher's ``TeacherInfo`` message.
        metadata: ``metadata.json`` as a dict.
        top_k, dtype: what the recording stores.
        temperature: the teacher's temperature when recorded.
        skipped: one line per thing not read (a batch cut by a killed writer, an empty
            shard), naming the shard; also logged and warned.

    Uncompressed shards are memory-mapped (rows are views); compressed ones are
    decompressed into memory when opened. Thread-safe for reads; works after ``fork``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata = _read_metadata(self.path)
        self.info = json_format.ParseDict(
            self.metadata["teacher"], pb.TeacherInfo(), ignore_unknown_fields=True
        )
        self.top_k = int(self.metadata["top_k"])
        self.dtype = str(self.metadata["dtype"])
        self.temperature = float(self.metadata.get("temperature", 1.0))
        #: The request options the recording was made at (``RequestOptions.recorded``;
        #: an option newer than the recording takes its default).
        self.options: dict[str, Any] = {
            **RequestOptions.recorded_defaults(),
            **self.metadata.get("options", {}),
        }
        self.skipped: list[str] = []
        self._maps: list[pa.MemoryMappedFile] = []
        self._chunks: list[_Chunk] = []
        keys: list[bytes] = []
        for shard in _shards(self.path):
            for batch in self._read_shard(shard):
                self._chunks.append(_Chunk(batch, self.top_k))
                keys.extend(batch.column("key").to_pylist())
        self._chunk_start = np.cumsum([0] + [c.num_rows for c in self._chunks])
        self._keys = keys
        self._copies: dict[bytes, list[_Copy]] | None = None
        for line in self.skipped:
            log.warning("%s", line)
            warnings.warn(line, stacklevel=2)

    def _read_shard(self, shard: Path) -> Iterator[pa.RecordBatch]:
        size = shard.stat().st_size
        if size == 0:
            self.skipped.append(f"recording {self.path}: {shard.name} is empty (0 bytes)")
            return
        source = pa.memory_map(str(shard))
        self._maps.append(source)
        try:
            stream = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError) as e:
            self.skipped.append(f"recording {self.path}: {shard.name}: no readable schema ({e})")
            return
        if stream.schema.field("ids").type.value_type.list_size != self.top_k:
            raise RecordingError(shard, None, f"ids: K differs from the recorded {self.top_k}")
        n = 0
        while True:
            try:
                batch = stream.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as e:
                self.skipped.append(
                    f"recording {self.path}: {shard.name}: kept {n} complete batches; skipped "
                    f"the {size - source.tell()} bytes after them (a batch cut short, e.g. by "
                    f"a killed writer: {e})"
                )
                return
            n += 1
            yield batch

    # -- access ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows (recorded sequences)."""
        return len(self._keys)

    @property
    def num_positions(self) -> int:
        return int(sum(int((c.ends - c.starts).sum()) for c in self._chunks))

    def row(self, i: int) -> RecordedSequence:
        """Row ``i`` (in shard order)."""
        if not 0 <= i < len(self._keys):
            raise IndexError(f"row {i} of a recording with {len(self._keys)} rows")
        c = int(np.searchsorted(self._chunk_start, i, side="right")) - 1
        return self._chunks[c].row(i - int(self._chunk_start[c]))

    def key(self, i: int) -> bytes:
        return self._keys[i]

    def __iter__(self) -> Iterator[RecordedSequence]:
        for chunk in self._chunks:
            for r in range(chunk.num_rows):
                yield chunk.row(r)

    def copies(self) -> dict[bytes, list[_Copy]]:
        """key -> every recorded row of that sequence (built on first use)."""
        if self._copies is None:
            copies: dict[bytes, list[_Copy]] = {}
            i = 0
            for chunk in self._chunks:
                for r in range(chunk.num_rows):
                    copies.setdefault(self._keys[i], []).append(
                        _Copy(
                            i, int(chunk.starts[r]), int(chunk.ends[r]), bool(chunk.has_sampled[r])
                        )
                    )
                    i += 1
            self._copies = copies
        return self._copies

    def find(self, token_ids: bytes, start: int, end: int, sampled: bool) -> RecordedSequence | str:
        """The recorded row holding positions ``[start, end)`` of this sequence (with
        sampled log-probs when ``sampled``), or a sentence saying what is missing."""
        found = self.copies().get(sequence_key(token_ids))
        if not found:
            return "the sequence is not recorded"
        covering = [c for c in found if c.start <= start and end <= c.end]
        if not covering:
            have = ", ".join(f"[{c.start}, {c.end})" for c in found)
            return f"positions [{start}, {end}) are not recorded (recorded: {have})"
        if sampled:
            covering = [c for c in covering if c.has_sampled]
            if not covering:
                return "its sampled log-probs are not recorded (recorded without them)"
        return self.row(covering[0].row)

    def close(self) -> None:
        self._chunks.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
