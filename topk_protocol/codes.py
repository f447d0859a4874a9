"""The status each typed error goes out with, by name, with no transport imported.

:class:`Status` names the canonical status codes (``google.rpc.Code``: gRPC's status
codes, whose names Google's HTTP APIs answer with too). The table :data:`STATUS` gives
each error kind of :mod:`topk_protocol.errors` its status; :func:`code_of` reads it. The
server's request pipeline (``teacher_server.pipeline``) answers with a :class:`Status`
and each front end maps it to its own transport: gRPC (:mod:`topk_protocol.status`, the
same names as ``grpc.StatusCode``), HTTP (``teacher_server.http_api.answers``).
"""

from __future__ import annotations

from enum import StrEnum

from topk_protocol.errors import (
    DataLossError,
    DeadlineExceededError,
    InvalidRequestError,
    NotRecordedError,
    ResourceExhaustedError,
    TeacherError,
    TeacherUnavailableError,
    UnauthenticatedError,
)

__all__ = ["STATUS", "Status", "code_of"]


class Status(StrEnum):
    """A canonical status code by name (the value is the name: a metric label, a JSON
    ``code``); ``grpc.StatusCode[status.name]`` is gRPC's."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


#: Error class -> the status it goes out with. The first entry of a status is the class
#: that status comes back as on the client (:mod:`topk_protocol.status`).
STATUS: tuple[tuple[type[TeacherError], Status], ...] = (
    (InvalidRequestError, Status.INVALID_ARGUMENT),
    (ResourceExhaustedError, Status.RESOURCE_EXHAUSTED),
    (UnauthenticatedError, Status.UNAUTHENTICATED),
    (TeacherUnavailableError, Status.UNAVAILABLE),
    (DeadlineExceededError, Status.DEADLINE_EXCEEDED),
    (NotRecordedError, Status.NOT_FOUND),
    (DataLossError, Status.DATA_LOSS),
)
_CODE_OF: dict[type[TeacherError], Status] = dict(STATUS)


def code_of(error: TeacherError) -> tuple[Status, str]:
    """``(status, reason)`` a typed error goes out with (the first class of its MRO in
    :data:`STATUS`); an error of no listed kind (a recording that cannot be read, ...) is
    INTERNAL. ``reason`` names the kind where the status alone does not (mostly empty)."""
    for cls in type(error).__mro__:
        if cls in _CODE_OF:
            return _CODE_OF[cls], error.reason
    return Status.INTERNAL, error.reason
