"""Typed exceptions of the protocol: the one error hierarchy of both sides.

Every exception is a :class:`TeacherError` (``TeacherError(message, code=None)``); the
ones caused by the caller's input are also ``ValueError``. The server's code
(validation, backends) raises them with no transport in sight; only the server's request
pipeline (``teacher_server.pipeline``) turns them into status codes, and the client
turns status codes back into them, with the server's message unchanged so that the field
and the limit it names reach the caller. The table between the two is
:mod:`topk_protocol.status` (the one module here that knows gRPC).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
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
]


class TeacherError(Exception):
    """Base of every error of the protocol, raised on either side.

    ``code`` is the gRPC status code the error arrived with (``None`` when it did not
    come over the wire). ``reason`` names the error kind where the status code alone
    does not (sent along with it; empty for most kinds).
    """

    reason: ClassVar[str] = ""

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

    reason: ClassVar[str] = "not_recorded"


class RecordingError(TeacherError):
    """A recording file is truncated, corrupted or not a recording.

    ``path`` and ``offset`` (byte offset in the file, ``None`` when not applicable) say
    where; both are in the message too.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int | None, message: str) -> None:
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
        self, path: str | os.PathLike[str], row: int | None, message: str, offset: int | None = None
    ) -> None:
        where = f"row {row}: " if row is not None else ""
        super().__init__(path, offset, where + message)
        self.row = row
