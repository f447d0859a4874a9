"""Recordings: a teacher's payloads as a directory of Apache Arrow IPC stream files.

A recording (also a *payload dataset*) is a directory of ``metadata.json`` and shards,
one row per scored sequence: its token ids, positions and the
:class:`~topk_protocol.arrays.SequenceArrays` the teacher answered (the columns:
:mod:`topk_protocol.recording.format`). Plain ``pyarrow`` and the Hugging Face
``datasets`` library read these files without this project (see ``docs/datasets.md``).

- :mod:`~topk_protocol.recording.format`: file names, the Arrow schema, sequence keys,
  dtype rules, ``metadata.json`` and a shard's schema checks.
- :mod:`~topk_protocol.recording.writer`: :class:`RecordingWriter`.
- :mod:`~topk_protocol.recording.reader`: :class:`RecordingReader`.
- :mod:`~topk_protocol.recording.index`: :class:`RowIndex`, the one index of the rows
  (which rows hold which sequence) that the writer and the reader share.

Why Arrow IPC streams (measured in ``benchmarks/bench_datasets.py``): with zstd buffer
compression they are half the wire's size (15% more than Parquet with zstd) and read
about as fast, uncompressed ones are memory-mapped without any decoding, and a stream is
readable up to its last complete batch, so a writer killed at any moment leaves a
readable file (a Parquet file without its footer is unreadable). Compression uses
Arrow's built-in codecs (zstd, lz4), so a student-only install reads and writes them.

Integrity (:mod:`topk_protocol.recording.integrity`): every row carries a CRC-32 of what it serves,
and every shard's schema metadata repeats ``metadata.json``'s format fields; the reader
verifies each row as it reads it and reports damage as a
:class:`~topk_protocol.errors.RecordingDamagedError` naming the shard and the row.

Crash safety: the writer writes its buffered rows as one record batch every
``flush_interval_s`` seconds (sooner once ``flush_bytes`` of arrays are buffered), so a
killed writer loses at most that interval's rows; the
reader keeps every complete batch and lists what it skipped in
:attr:`RecordingReader.skipped`. On object storage (``s3://...``; any filesystem but the
local one) each flush uploads one whole shard object, which the store publishes only
when the upload completes, so no reader ever sees part of a batch; the reader streams
such a recording, a few batches in memory (``docs/datasets.md``, "Object storage").
"""

from topk_protocol.recording.format import (
    COMPRESSIONS,
    DEFAULT_FLUSH_BYTES,
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_OBJECT_FLUSH_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    SHARD_SUFFIX,
    can_serve_dtype,
    cast_like_teacher,
    recording_schema,
    sequence_key,
)
from topk_protocol.recording.index import RowIndex, RowSpan
from topk_protocol.recording.reader import RecordingReader
from topk_protocol.recording.writer import RecordingWriter

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_FLUSH_BYTES",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_OBJECT_FLUSH_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "SHARD_SUFFIX",
    "RecordingReader",
    "RecordingWriter",
    "RowIndex",
    "RowSpan",
    "can_serve_dtype",
    "cast_like_teacher",
    "recording_schema",
    "sequence_key",
]
