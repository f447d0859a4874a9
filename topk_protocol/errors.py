"""Typed exceptions of the protocol, and the gRPC status -> exception mapping.

Every exception is a :class:`TeacherError`; the ones caused by the caller's input are
also ``ValueError``. Each carries the gRPC status code (``code``) when one is involved
and the server's message unchanged, so that the field and the limit it names reach the
caller.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = [
    "DataLossError",
    "DeadlineExceededError",
    "InvalidRequestError",
    "NotRecordedError",
    "RecordingDamagedError",
    "RecordingError",
    "ResourceExhaustedError",
    "TeacherError",
    "TeacherMismatchError",
    "TeacherUnavailableError",
    "UnauthenticatedError",
    "VocabMismatchError",
    "error_from_code",
    "error_from_rpc",
]


class TeacherError(Exception):
    """Base of every error raised by the student client.

    ``code`` is the gRPC status code involved (``None`` for client-side errors).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidRequestError(TeacherError, ValueError):
    """The request is invalid (INVALID_ARGUMENT / OUT_OF_RANGE, or refused client-side)."""


class ResourceExhaustedError(TeacherError):
    """A server limit the request itself must respect (tokens per request, message size):
    not retried. An overloaded teacher answers UNAVAILABLE instead, which is retried."""


class UnauthenticatedError(TeacherError):
    """The bearer token is missing or wrong."""


class TeacherUnavailableError(TeacherError):
    """No teacher answered after every try (``unavailable after N tries: ...``)."""


class DeadlineExceededError(TeacherError):
    """A call did not finish within its deadline (``timeout_s``)."""


class TeacherMismatchError(TeacherError, ValueError):
    """The teacher is not the one the student expects (e.g. another temperature)."""


class VocabMismatchError(TeacherMismatchError):
    """The teacher's vocabulary (size or tokenizer fingerprint) is not the expected one."""


class NotRecordedError(TeacherError):
    """Replay: the request (or one of its sequences) is not in the recording."""


class RecordingError(TeacherError):
    """A recording file is truncated, corrupted or not a recording.

    ``path`` and ``offset`` (byte offset in the file, ``None`` when not applicable) say
    where; both are in the message too.
    """

    def __init__(self, path: str | Path, offset: int | None, message: str) -> None:
        where = f"recording {path}" + (f": at byte offset {offset}" if offset is not None else "")
        super().__init__(f"{where}: {message}")
        self.path = Path(path)
        self.offset = offset


class DataLossError(TeacherError):
    """Stored data is damaged (DATA_LOSS): e.g. a replayed row failed its checksum. Not
    retried: the same row is damaged on every try."""


class RecordingDamagedError(RecordingError, DataLossError):
    """A recording's stored bytes are damaged, or its ``metadata.json`` and its shards
    disagree: nothing is served from what is damaged.

    ``path`` is the shard (or ``metadata.json``); ``row`` the row inside that shard
    (``None`` when the damage is not one row's, e.g. a schema or a whole batch).
    """

    def __init__(
        self, path: str | Path, row: int | None, message: str, offset: int | None = None
    ) -> None:
        where = f"row {row}: " if row is not None else ""
        super().__init__(path, offset, where + message)
        self.row = row
        self.code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[TeacherError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: TeacherUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: NotRecordedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
}
_CODE_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_from_code(code: grpc.StatusCode | int, message: str) -> TeacherError:
    """The typed exception for a gRPC status (enum or its integer value) and message."""
    if not isinstance(code, grpc.StatusCode):
        code = _CODE_BY_VALUE.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, TeacherError)
    text = message if cls is not TeacherError else f"teacher error {code.name}: {message}"
    return cls(text, code)


def error_from_rpc(err: grpc.RpcError) -> TeacherError:
    """The typed exception for a failed gRPC call."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return error_from_code(code, details or code.name)
