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
``row_crc32``                 ``uint32``                                 the row's checksum
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

Integrity (:mod:`topk_protocol.integrity`): every row carries a CRC-32 of what it serves,
and every shard's schema metadata repeats ``metadata.json``'s format fields. A row is
verified each time it is read; a row that fails, a batch or shard that does not parse, a
shard whose schema disagrees with ``metadata.json`` is reported as a
:class:`~topk_protocol.errors.RecordingDamagedError` naming the shard (or
``metadata.json``) and the row, and the intact rows still replay. Shards written before
checksums (no ``row_crc32`` column) still open, with one warning.

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
    DEFAULT_TEACHER_TEMPERATURE,
    RequestOptions,
    check_temperature,
    decode_sequence,
    dtype_from_name,
    dtype_name,
    pb,
    request_spans,
    teacher_temperature,
)
from topk_protocol._closeable import Closeable
from topk_protocol.codec import _bf16_bits_to_f32, _f32_to_bf16_bits
from topk_protocol.errors import RecordingDamagedError, RecordingError
from topk_protocol.integrity import (
    CHECKSUM_COLUMN,
    CHECKSUM_NAME,
    FORMAT_FIELDS,
    SCHEMA_METADATA_KEY,
    format_disagreements,
    row_checksum,
    shard_format,
)

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
_DTYPES = ("float32", "float16", "bfloat16")
#: What reading damaged Arrow bytes raises (ArrowInvalid and UnicodeDecodeError are
#: ValueErrors).
_READ_ERRORS = (pa.ArrowException, OSError, ValueError)
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


def recording_schema(
    top_k: int, dtype: str, fmt: dict[str, Any] | None = None, *, checksums: bool = True
) -> pa.Schema:
    """The Arrow schema of a recording with ``top_k`` and log-prob ``dtype`` (name).

    ``fmt``: the other format fields the schema metadata repeats (``vocab_size``,
    ``tokenizer_fingerprint``, ``temperature``); ``checksums=False``: the columns of a
    shard written before the ``row_crc32`` column existed.
    """
    f = _storage_type(dtype)
    fields = [
        pa.field("key", pa.binary(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("position_start", pa.int32(), nullable=False),
        pa.field("position_end", pa.int32(), nullable=False),
        pa.field("ids", pa.list_(pa.list_(pa.int32(), top_k)), nullable=False),
        pa.field("logprobs", pa.list_(pa.list_(f, top_k)), nullable=False),
        pa.field("sampled_logprobs", pa.list_(f)),
    ]
    stated: dict[str, Any] = {"top_k": top_k, "dtype": dtype}
    if checksums:
        fields.append(pa.field(CHECKSUM_COLUMN, pa.uint32(), nullable=False))
        stated.update(fmt or {})
        stated["checksum"] = CHECKSUM_NAME
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: json.dumps(stated, sort_keys=True)})


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


#: ``metadata.json`` fields the reader relies on, with the JSON types they must have.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "teacher": (dict,),
    "top_k": (int,),
    "dtype": (str,),
    "vocab_size": (int,),
    "tokenizer_fingerprint": (str,),
}


def _read_metadata(root: Path) -> tuple[dict[str, Any], pb.TeacherInfo]:
    """``metadata.json`` checked field by field, and the teacher's info it holds; every
    problem is a :class:`RecordingError` naming ``metadata.json`` and the field."""
    path = root / METADATA_FILE
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RecordingError(root, None, f"no {METADATA_FILE}: not a recording") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise RecordingError(path, None, f"unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise RecordingError(path, None, f"not a JSON object but {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        raise RecordingError(path, None, f"format {meta.get('format')!r}, not {FORMAT_NAME!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise RecordingError(
            path,
            None,
            f"format_version {meta.get('format_version')}; this reader reads {FORMAT_VERSION}",
        )
    for name, types in _META_TYPES.items():
        value = meta.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join(t.__name__ for t in types)
            raise RecordingError(path, None, f"{name}: {value!r} is not a JSON {want}")
    meta.setdefault("temperature", DEFAULT_TEACHER_TEMPERATURE)
    problems = []
    if not isinstance(meta.get("options", {}), dict):
        problems.append(f"options: {meta['options']!r} is not a JSON object")
    if meta["top_k"] < 1:
        problems.append(f"top_k: {meta['top_k']} is not >= 1")
    if meta["dtype"] not in _DTYPES:
        problems.append(f"dtype: {meta['dtype']!r} is not one of {', '.join(_DTYPES)}")
    try:
        meta["temperature"] = check_temperature(meta["temperature"], "temperature")
    except (TypeError, ValueError) as e:
        problems.append(str(e))
    try:
        info = json_format.ParseDict(meta["teacher"], pb.TeacherInfo(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise RecordingError(path, None, f"teacher: not a TeacherInfo ({e})") from None
    for name, theirs in (
        ("vocab_size", int(info.vocab_size)),
        ("tokenizer_fingerprint", info.tokenizer_fingerprint),
        ("temperature", teacher_temperature(info)),
    ):
        if meta[name] != theirs and not problems:
            problems.append(f"{name}: {meta[name]!r}, but teacher.{name} says {theirs!r}")
    if problems:
        raise RecordingError(path, None, "; ".join(problems))
    return meta, info


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
        :meth:`~student_client.data.payload.ResponseAssembler.merged_response`; ``options``
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
            schema = recording_schema(self.top_k, self.dtype, self._format())
            if self._stream is None:
                self._open_shard(schema)
            rows = [r for _, r in self._buffer]
            f = _storage_type(self.dtype)
            checksums = [
                row_checksum(k, r.token_ids, r.start, r.end, r.ids, r.logprobs, r.sampled_logprobs)
                for k, r in self._buffer
            ]
            batch = pa.record_batch(
                [
                    pa.array([k for k, _ in self._buffer], pa.binary()),
                    _list_column([r.token_ids for r in rows], pa.int32()),
                    pa.array([r.start for r in rows], pa.int32()),
                    pa.array([r.end for r in rows], pa.int32()),
                    _list_column([r.ids for r in rows], pa.int32(), self.top_k),
                    _list_column([r.logprobs for r in rows], f, self.top_k),
                    _sampled_column([r.sampled_logprobs for r in rows], f),
                    pa.array(checksums, pa.uint32()),
                ],
                schema=schema,
            )
            assert self._stream is not None
            self._stream.write_batch(batch)
            self._file.flush()
            self.rows_written += len(rows)
            self._buffer.clear()

    def _format(self) -> dict[str, Any]:
        """The format fields (besides K and dtype) every shard's schema repeats."""
        return {
            "vocab_size": int(self.info.vocab_size),
            "tokenizer_fingerprint": self.info.tokenizer_fingerprint,
            "temperature": teacher_temperature(self.info),
        }

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
    """numpy views of one record batch's columns (no copy for uncompressed shards).

    ``shard`` and ``first_row`` (the batch's first row within the shard) say where each
    row is, for the error that names a damaged one.
    """

    def __init__(self, batch: pa.RecordBatch, top_k: int, shard: Path, first_row: int) -> None:
        self.shard = shard
        self.first_row = first_row
        self.num_rows = batch.num_rows
        self.keys: list[bytes] = batch.column("key").to_pylist()
        self.starts = batch.column("position_start").to_numpy()
        self.ends = batch.column("position_end").to_numpy()
        tok = batch.column("token_ids")
        self.tok_offsets = tok.offsets.to_numpy()
        self.tok_values = tok.values.to_numpy()
        ids, lps = batch.column("ids"), batch.column("logprobs")
        self.row_offsets = ids.offsets.to_numpy()
        self.ids = ids.values.flatten().to_numpy().reshape(-1, top_k)
        self.lps = lps.values.flatten().to_numpy().reshape(-1, top_k)
        self.lps_offsets = lps.offsets.to_numpy()
        sp = batch.column("sampled_logprobs")
        self.has_sampled = sp.is_valid().to_numpy(zero_copy_only=False)
        self.sp_offsets = sp.offsets.to_numpy()
        self.sp_values = sp.values.to_numpy()
        names = batch.schema.names
        self.checksums = (
            batch.column(CHECKSUM_COLUMN).to_numpy() if CHECKSUM_COLUMN in names else None
        )

    def row(self, r: int, vocab_size: int) -> RecordedSequence:
        """Row ``r``, verified: its checksum (when the shard has them), that its arrays
        have the lengths its positions say, and that its ids lie in the vocabulary.
        Raises :class:`RecordingDamagedError` naming the shard and the row otherwise."""
        a, b = self.row_offsets[r], self.row_offsets[r + 1]
        sp = None
        if self.has_sampled[r]:
            sp = self.sp_values[self.sp_offsets[r] : self.sp_offsets[r + 1]]
        row = RecordedSequence(
            token_ids=self.tok_values[self.tok_offsets[r] : self.tok_offsets[r + 1]],
            ids=self.ids[a:b],
            logprobs=self.lps[self.lps_offsets[r] : self.lps_offsets[r + 1]],
            sampled_logprobs=sp,
            start=int(self.starts[r]),
            end=int(self.ends[r]),
        )
        problem = self._problem(r, row, vocab_size)
        if problem is not None:
            raise RecordingDamagedError(self.shard, self.first_row + r, problem)
        return row

    def _problem(self, r: int, row: RecordedSequence, vocab_size: int) -> str | None:
        s = row.end - row.start
        if not 0 <= row.start <= row.end <= len(row.token_ids):
            return (
                f"positions [{row.start}, {row.end}) are not inside its "
                f"{len(row.token_ids)} tokens: the shard is damaged"
            )
        lengths = {len(row.ids), len(row.logprobs)}
        if row.sampled_logprobs is not None:
            lengths.add(len(row.sampled_logprobs))
        if lengths != {s}:
            return f"its arrays hold {sorted(lengths)} rows for {s} positions: the shard is damaged"
        if self.checksums is not None:
            crc = row_checksum(
                self.keys[r],
                row.token_ids,
                row.start,
                row.end,
                row.ids,
                row.logprobs,
                row.sampled_logprobs,
            )
            if crc != int(self.checksums[r]):
                return (
                    f"checksum mismatch ({CHECKSUM_COLUMN} {int(self.checksums[r]):#010x}, the "
                    f"row's bytes give {crc:#010x}): the shard is damaged; this row is not served"
                )
        for name, arr in (("token_ids", row.token_ids), ("ids", row.ids)):
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
                return (
                    f"{name} [{int(arr.min())}, {int(arr.max())}] are outside the vocabulary "
                    f"[0, {vocab_size}) of {METADATA_FILE}: the shard or {METADATA_FILE} is damaged"
                )
        return None


@dataclass(frozen=True)
class _ShardCheck:
    """What a shard's schema says about it: ``damage`` (its columns or schema metadata
    are not a recording's), or how it ``disagrees`` with ``metadata.json``."""

    damage: str | None = None
    disagrees: tuple[str, ...] = ()
    checksums: bool = False


def _check_schema(schema: pa.Schema, meta: dict[str, Any]) -> _ShardCheck:
    """Compare a shard's schema with what a recording's must be, and with ``meta``."""
    try:
        return _compare_schema(schema, meta)
    except (ValueError, pa.ArrowException) as e:  # e.g. a field name that is not UTF-8
        return _ShardCheck(damage=f"its schema does not decode ({type(e).__name__}: {e})")


def _compare_schema(schema: pa.Schema, meta: dict[str, Any]) -> _ShardCheck:
    fmt = shard_format(schema.metadata)
    if isinstance(fmt, str):
        return _ShardCheck(damage=fmt)
    top_k, dtype = fmt.get("top_k"), fmt.get("dtype")
    if not isinstance(top_k, int) or top_k < 1 or dtype not in _DTYPES:
        return _ShardCheck(damage=f"its schema states top_k {top_k!r}, dtype {dtype!r}")
    checksums = CHECKSUM_COLUMN in schema.names
    want = recording_schema(top_k, str(dtype), checksums=checksums).remove_metadata()
    if not schema.remove_metadata().equals(want):
        return _ShardCheck(
            damage=f"its columns are not those of a K = {top_k} {dtype} recording: "
            + ", ".join(f"{f.name}: {f.type}" for f in schema)
        )
    if checksums and not set(FORMAT_FIELDS) <= set(fmt):
        missing = sorted(set(FORMAT_FIELDS) - set(fmt))
        return _ShardCheck(damage=f"its schema metadata lacks {', '.join(missing)}")
    return _ShardCheck(disagrees=tuple(format_disagreements(meta, fmt)), checksums=checksums)


class RecordingReader(Closeable):
    """Reads a recording directory: every complete record batch of every shard.

    Attributes:
        info: the recorded teacher's ``TeacherInfo`` message.
        metadata: ``metadata.json`` as a dict.
        top_k, dtype: what the recording stores.
        temperature: the teacher's temperature when recorded.
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
        self.metadata, self.info = _read_metadata(self.path)
        self.top_k = int(self.metadata["top_k"])
        self.dtype = str(self.metadata["dtype"])
        self.temperature = float(self.metadata["temperature"])
        self._vocab_size = int(self.metadata["vocab_size"])
        #: The request options the recording was made at (``RequestOptions.recorded``;
        #: an option newer than the recording takes its default).
        self.options: dict[str, Any] = {
            **RequestOptions.recorded_defaults(),
            **self.metadata.get("options", {}),
        }
        self.skipped: list[str] = []
        self.damaged: list[RecordingDamagedError] = []
        self.unverified: list[str] = []
        self._maps: list[pa.MemoryMappedFile] = []
        self._chunks: list[_Chunk] = []
        disagreeing: list[tuple[Path, tuple[str, ...]]] = []
        agreeing = 0
        for shard in _shards(self.path):
            stream = self._open_shard(shard)
            if stream is None:
                continue
            check = _check_schema(stream.schema, self.metadata)
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
                self._chunks.append(_Chunk(batch, self.top_k, shard, first_row))
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
        self._keys = [k for c in self._chunks for k in c.keys]
        self._copies: dict[bytes, list[_Copy]] | None = None
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
        except _READ_ERRORS as e:
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
            except _READ_ERRORS as e:
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
            except _READ_ERRORS as e:
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
        return len(self._keys)

    @property
    def num_positions(self) -> int:
        return int(sum(int((c.ends - c.starts).sum()) for c in self._chunks))

    def row(self, i: int) -> RecordedSequence:
        """Row ``i`` (in shard order), verified (checksum, lengths, vocabulary); raises
        :class:`RecordingDamagedError` naming its shard and row when damaged."""
        if not 0 <= i < len(self._keys):
            raise IndexError(f"row {i} of a recording with {len(self._keys)} rows")
        c = int(np.searchsorted(self._chunk_start, i, side="right")) - 1
        return self._chunks[c].row(i - int(self._chunk_start[c]), self._vocab_size)

    def key(self, i: int) -> bytes:
        return self._keys[i]

    def __iter__(self) -> Iterator[RecordedSequence]:
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
        sampled log-probs when ``sampled``), or a sentence saying what is missing.

        Copies that fail verification are passed over for an intact one; when every
        copy is damaged, raises the first one's :class:`RecordingDamagedError`.
        """
        key = sequence_key(token_ids)
        found = self.copies().get(key)
        if not found:
            return "the sequence is not recorded" + self._damage_note()
        covering = [c for c in found if c.start <= start and end <= c.end]
        if not covering:
            have = ", ".join(f"[{c.start}, {c.end})" for c in found)
            return f"positions [{start}, {end}) are not recorded (recorded: {have})"
        if sampled:
            covering = [c for c in covering if c.has_sampled]
            if not covering:
                return "its sampled log-probs are not recorded (recorded without them)"
        first: RecordingDamagedError | None = None
        tokens = np.frombuffer(token_ids, dtype="<i4")
        for c in covering:
            try:
                row = self.row(c.row)
            except RecordingDamagedError as e:
                first = first or e
                continue
            if np.array_equal(row.token_ids, tokens):
                return row
        if first is not None:
            raise first
        return "the sequence is not recorded" + self._damage_note()

    def _damage_note(self) -> str:
        if not self.damaged and not self.skipped:
            return ""
        return f" (the recording has unreadable parts: {self.skipped[0]})"

    def close(self) -> None:
        self._chunks.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
