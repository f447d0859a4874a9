"""Recording files: teacher requests and their complete answers, with an index.

Layout (all integers little-endian)::

    header   magic b"TOPKREC\\0" | u32 format version | u32 H | u32 crc32(body) |
             body[H] = u32 I | TeacherInfo[I] (serialized) | JSON metadata (UTF-8)
    records  u8 kind | u8 flags | u16 0 | u32 crc32(stored) | u64 N | stored[N]
             kind 1 (exchange): body = u32 R | ScoreRequest[R] | ScoreResponse
             kind 2 (index):    body = u32 C | C x (32-byte request key | u64 offset)
             flags bit 0: the body is zstd-compressed (each record on its own, so any
             record can be read alone)
    footer   u64 index offset | u32 C | u32 crc32(previous 12 bytes) | b"TOPKEND\\0"

A record's ``ScoreResponse`` is the whole answer (stream chunks joined, see
:meth:`~student_client.payload.ResponseAssembler.merged_response`). The key of a request
is :func:`request_key` (its request_id does not count). Opening reads the footer and the
index; a file without them (writer killed before ``close``) is scanned, with a warning.
A truncated or corrupted file raises :class:`RecordingError` naming the file and the
byte offset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from google.protobuf.message import DecodeError

from student_client._closeable import Closeable
from student_client.errors import RecordingError
from student_client.payload import request_dtype, request_includes_sampled, request_spans
from student_client.wire import pb

__all__ = [
    "FILE_MAGIC",
    "FORMAT_VERSION",
    "RecordingReader",
    "RecordingWriter",
    "request_key",
    "sequence_key",
]

log = logging.getLogger(__name__)

FILE_MAGIC = b"TOPKREC\x00"
FOOTER_MAGIC = b"TOPKEND\x00"
FORMAT_VERSION = 1

_HEAD = struct.Struct("<8sIII")  # magic, version, header length, header crc
_RECORD = struct.Struct("<BBHIQ")  # kind, flags, reserved, crc32, stored length
_FOOTER = struct.Struct("<QII8s")  # index offset, count, crc32, magic
_ENTRY = struct.Struct("<32sQ")
_U32 = struct.Struct("<I")
_KIND_EXCHANGE = 1
_KIND_INDEX = 2
_FLAG_ZSTD = 1


def request_key(request: pb.ScoreRequest) -> bytes:
    """sha256 of what determines the answer: per sequence its token ids and positions
    (unset start/end normalized to 0/L), then K, dtype (UNSPECIFIED = float16) and
    include_sampled. The request_id is ignored. Returns 32 bytes."""
    h = hashlib.sha256(b"topk-distill/request/v1")
    spans = request_spans(request)
    h.update(
        struct.pack(
            "<IIBI",
            int(request.top_k),
            request_dtype(request),
            request_includes_sampled(request),
            len(spans),
        )
    )
    for seq, (start, end) in zip(request.sequences, spans, strict=True):
        h.update(struct.pack("<QII", len(seq.token_ids), start, end))
        h.update(seq.token_ids)
    return h.digest()


def sequence_key(token_ids: bytes, top_k: int, start: int, end: int) -> bytes:
    """sha256 of one sequence's scoring: int32 LE token ids, K and ``[start, end)``."""
    h = hashlib.sha256(b"topk-distill/sequence/v1")
    h.update(struct.pack("<IIIQ", top_k, start, end, len(token_ids)))
    h.update(token_ids)
    return h.digest()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is installed with the server extra
        return None
    return zstandard


class RecordingWriter(Closeable):
    """Appends request/answer pairs to a new recording file.

    Args:
        path: file to create (overwritten).
        info: the teacher's ``TeacherInfo`` message, stored in the header.
        compression: ``"zstd"``, ``"none"`` or ``"auto"`` (zstd when ``zstandard`` is
            installed).
        level: zstd level.
        metadata: extra JSON-serializable metadata for the header.

    Thread-safe. A request already recorded (same :func:`request_key`) is not written
    again. :meth:`close` writes the index and the footer.
    """

    def __init__(
        self,
        path: str | Path,
        info: pb.TeacherInfo,
        *,
        compression: str = "auto",
        level: int = 3,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        zstd = _zstd()
        if compression == "auto":
            compression = "zstd" if zstd is not None else "none"
        if compression not in ("zstd", "none"):
            raise ValueError(f"compression: {compression!r}; use 'zstd', 'none' or 'auto'")
        if compression == "zstd" and zstd is None:
            raise ValueError("compression: 'zstd' needs the zstandard package")
        self.path = Path(path)
        self._compressor = zstd.ZstdCompressor(level=level) if compression == "zstd" else None
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}
        meta = {
            "format": "topk-distill-recording",
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "compression": compression,
            **(metadata or {}),
        }
        info_bytes = info.SerializeToString()
        body = _U32.pack(len(info_bytes)) + info_bytes + json.dumps(meta).encode()
        self._file: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(_HEAD.pack(FILE_MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)))
        self._file.write(body)
        self._file.flush()
        self._offset = _HEAD.size + len(body)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, request: pb.ScoreRequest) -> bool:
        return request_key(request) in self._index

    def _write_record(self, kind: int, body: bytes) -> int:
        assert self._file is not None
        flags = 0
        if self._compressor is not None:
            body = self._compressor.compress(body)
            flags |= _FLAG_ZSTD
        offset = self._offset
        self._file.write(_RECORD.pack(kind, flags, 0, zlib.crc32(body), len(body)))
        self._file.write(body)
        self._offset += _RECORD.size + len(body)
        return offset

    def write(self, request: pb.ScoreRequest, response: pb.ScoreResponse) -> bool:
        """Record one request and its complete answer; False if it was already recorded."""
        key = request_key(request)
        req = request.SerializeToString()
        body = _U32.pack(len(req)) + req + response.SerializeToString()
        with self._lock:
            if self._file is None:
                raise ValueError(f"recording {self.path}: already closed")
            if key in self._index:
                return False
            self._index[key] = self._write_record(_KIND_EXCHANGE, body)
            self._file.flush()
        return True

    def close(self) -> None:
        """Write the index and the footer, and close the file."""
        with self._lock:
            if self._file is None:
                return
            entries = b"".join(_ENTRY.pack(k, off) for k, off in self._index.items())
            index_offset = self._write_record(_KIND_INDEX, _U32.pack(len(self._index)) + entries)
            head = struct.pack("<QI", index_offset, len(self._index))
            self._file.write(
                _FOOTER.pack(index_offset, len(self._index), zlib.crc32(head), FOOTER_MAGIC)
            )
            self._file.close()
            self._file = None


class RecordingReader(Closeable):
    """Random access to a recording by request key.

    Args:
        path: the recording.
        strict: when the index is missing and the scan meets a truncated last record,
            raise (True) or keep the complete records and warn (False).

    Attributes:
        info: the ``TeacherInfo`` message of the recorded teacher.
        metadata: the header's JSON metadata.
        index_source: ``"index"`` (read from the footer) or ``"scan"`` (rebuilt).

    Thread-safe (reads use ``os.pread``).
    """

    def __init__(self, path: str | Path, *, strict: bool = True) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._size = os.fstat(self._fd).st_size
            self._data_start = self._read_header()
            self._index: dict[bytes, int] = {}
            if self._read_index():
                self.index_source = "index"
            else:
                self.index_source = "scan"
                self._scan(strict)
        except BaseException:
            os.close(self._fd)
            raise

    # -- low level ---------------------------------------------------------------------
    def _error(self, offset: int | None, message: str) -> RecordingError:
        return RecordingError(self.path, offset, message)

    def _read(self, offset: int, n: int, what: str) -> bytes:
        if offset + n > self._size:
            raise self._error(
                offset,
                f"truncated {what}: needs {n} bytes, the file ends {self._size - offset} "
                "bytes later",
            )
        data = os.pread(self._fd, n, offset)
        if len(data) != n:  # pragma: no cover - the size was checked
            raise self._error(offset, f"short read of {what}")
        return data

    def _read_header(self) -> int:
        if self._size < _HEAD.size:
            raise self._error(0, f"truncated header: the file has {self._size} bytes")
        magic, version, length, crc = _HEAD.unpack(self._read(0, _HEAD.size, "header"))
        if magic != FILE_MAGIC:
            raise self._error(0, f"not a topk-distill recording (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise self._error(8, f"format version {version}; this reader reads {FORMAT_VERSION}")
        body = self._read(_HEAD.size, length, "header")
        if zlib.crc32(body) != crc:
            raise self._error(_HEAD.size, "header CRC32 mismatch (corrupted)")
        (info_len,) = _U32.unpack_from(body)
        try:
            self.info = pb.TeacherInfo.FromString(body[4 : 4 + info_len])
            self.metadata: dict[str, Any] = json.loads(body[4 + info_len :].decode())
        except (DecodeError, ValueError) as e:
            raise self._error(_HEAD.size, f"unreadable header: {e}") from None
        return _HEAD.size + length

    def _record(self, offset: int) -> tuple[int, bytes, int]:
        """Read and check the record at ``offset``: ``(kind, body, next offset)``."""
        kind, flags, _, crc, n = _RECORD.unpack(self._read(offset, _RECORD.size, "record header"))
        if kind not in (_KIND_EXCHANGE, _KIND_INDEX):
            raise self._error(offset, f"unknown record kind {kind} (corrupted)")
        if offset + _RECORD.size + n > self._size:
            raise self._error(
                offset,
                f"truncated record: its {_RECORD.size}-byte header announces {n} bytes, the "
                f"file ends {self._size - offset - _RECORD.size} bytes after the header",
            )
        body = self._read(offset + _RECORD.size, n, "record")
        if zlib.crc32(body) != crc:
            raise self._error(offset, "record CRC32 mismatch (corrupted)")
        if flags & _FLAG_ZSTD:
            zstd = _zstd()
            if zstd is None:  # pragma: no cover
                raise self._error(offset, "the record is zstd-compressed: install zstandard")
            try:
                body = zstd.ZstdDecompressor().decompress(body)
            except zstd.ZstdError as e:
                raise self._error(offset, f"zstd: {e}") from None
        return kind, body, offset + _RECORD.size + n

    def _exchange(self, offset: int, body: bytes) -> tuple[pb.ScoreRequest, pb.ScoreResponse]:
        if len(body) < 4:
            raise self._error(offset, "exchange record shorter than its length prefix")
        (r,) = _U32.unpack_from(body)
        if 4 + r > len(body):
            raise self._error(offset, f"request length {r} exceeds the record")
        try:
            return (
                pb.ScoreRequest.FromString(body[4 : 4 + r]),
                pb.ScoreResponse.FromString(body[4 + r :]),
            )
        except DecodeError as e:
            raise self._error(offset, f"unreadable message: {e}") from None

    def _read_index(self) -> bool:
        if self._size < self._data_start + _FOOTER.size:
            return False
        footer_at = self._size - _FOOTER.size
        offset, count, crc, magic = _FOOTER.unpack(self._read(footer_at, _FOOTER.size, "footer"))
        if magic != FOOTER_MAGIC:
            return False
        if zlib.crc32(struct.pack("<QI", offset, count)) != crc:
            raise self._error(footer_at, "footer CRC32 mismatch (corrupted)")
        if not self._data_start <= offset < footer_at:
            raise self._error(footer_at, f"footer points to offset {offset}, outside the records")
        kind, body, end = self._record(offset)
        if kind != _KIND_INDEX or end != footer_at:
            raise self._error(offset, "the footer does not point to the index record")
        (n,) = _U32.unpack_from(body)
        if n != count or len(body) != 4 + n * _ENTRY.size:
            raise self._error(offset, f"index record holds {len(body)} bytes for {count} entries")
        for key, off in _ENTRY.iter_unpack(body[4:]):
            if not self._data_start <= off < offset:
                raise self._error(
                    offset, f"index entry points to offset {off}, outside the records"
                )
            self._index[key] = off
        return True

    def _scan(self, strict: bool) -> None:
        offset = self._data_start
        while offset < self._size:
            try:
                kind, body, nxt = self._record(offset)
            except RecordingError as e:
                if strict or "truncated" not in str(e):
                    raise
                warnings.warn(f"{e}; kept the {len(self._index)} complete records", stacklevel=3)
                break
            if kind == _KIND_EXCHANGE:
                request, _ = self._exchange(offset, body)
                self._index.setdefault(request_key(request), offset)
            offset = nxt
        message = (
            f"recording {self.path}: no index at the end (the writer was not closed); "
            f"scanned {len(self._index)} records"
        )
        log.warning(message)
        warnings.warn(message, stacklevel=3)

    # -- public ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        return list(self._index)

    def read_at(self, offset: int) -> tuple[pb.ScoreRequest, pb.ScoreResponse]:
        """The exchange record at ``offset`` (CRC checked)."""
        kind, body, _ = self._record(offset)
        if kind != _KIND_EXCHANGE:
            raise self._error(offset, "expected an exchange record")
        return self._exchange(offset, body)

    def get(self, key: bytes) -> tuple[pb.ScoreRequest, pb.ScoreResponse] | None:
        """The recorded request and answer with this key, or None. Random access."""
        offset = self._index.get(key)
        if offset is None:
            return None
        request, response = self.read_at(offset)
        if request_key(request) != key:
            raise self._error(offset, "the index points to another request (corrupted index)")
        return request, response

    def lookup(self, request: pb.ScoreRequest) -> pb.ScoreResponse | None:
        """The recorded answer to ``request``, or None."""
        found = self.get(request_key(request))
        return None if found is None else found[1]

    def offsets(self) -> list[int]:
        """Offsets of every exchange record, in file order."""
        return sorted(self._index.values())

    def __iter__(self) -> Iterator[tuple[pb.ScoreRequest, pb.ScoreResponse]]:
        for offset in self.offsets():
            yield self.read_at(offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
