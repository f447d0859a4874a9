"""The table between the typed errors (:mod:`topk_protocol.errors`) and gRPC status codes.

The server raises typed errors; its request pipeline answers with :func:`status_of` (the
code, and the error's ``reason`` where the code alone does not say what happened:
NOT_FOUND is :class:`NotRecordedError` only with reason ``not_recorded``). The client
turns a status back into the typed error with :func:`error_from_code` /
:func:`error_from_rpc`. Both directions read the one table,
:data:`topk_protocol.codes.STATUS` (transport-free: status names), in gRPC's codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from topk_protocol.codes import STATUS, Status, code_of
from topk_protocol.errors import InvalidRequestError, TeacherError, UnauthenticatedError

__all__ = ["REASON_KEY", "error_from_code", "error_from_rpc", "grpc_code", "status_of"]

#: Trailing-metadata key of an error's ``reason`` on a failed unary call (a ScoreStream
#: ``Error`` message carries it in its ``reason`` field).
REASON_KEY = "topk-error-reason"


def grpc_code(status: Status) -> grpc.StatusCode:
    """gRPC's status code of the same name."""
    return grpc.StatusCode[status.name]


#: Error class -> the status it goes out with (the transport-free table,
#: :data:`topk_protocol.codes.STATUS`, in gRPC's codes).
_CODE_OF: dict[type[TeacherError], grpc.StatusCode] = {cls: grpc_code(s) for cls, s in STATUS}
#: Codes that come back as a typed error whatever the reason (NOT_FOUND needs one).
_BY_CODE: dict[grpc.StatusCode, type[TeacherError]] = {
    code: cls for cls, code in _CODE_OF.items() if not cls.reason
} | {
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
}
_BY_REASON: dict[str, type[TeacherError]] = {cls.reason: cls for cls, _ in STATUS if cls.reason}
_CODE_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_of(error: TeacherError) -> tuple[grpc.StatusCode, str]:
    """``(code, reason)`` a typed error goes out with; an error of no listed kind (a
    recording that cannot be read, ...) is INTERNAL."""
    status, reason = code_of(error)
    return grpc_code(status), reason


def error_from_code(code: grpc.StatusCode | int, message: str, reason: str = "") -> TeacherError:
    """The typed exception for a gRPC status (enum or its integer value), its message and
    the error's ``reason`` (empty when none came)."""
    if not isinstance(code, grpc.StatusCode):
        code = _CODE_BY_VALUE.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_REASON.get(reason) if reason else None
    if cls is None or _CODE_OF[cls] is not code:
        cls = _BY_CODE.get(code, TeacherError)
    text = message if cls is not TeacherError else f"teacher error {code.name}: {message}"
    return cls(text, code)


def _reason(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def error_from_rpc(err: grpc.RpcError) -> TeacherError:
    """The typed exception for a failed gRPC call (reads the reason from its trailers)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return error_from_code(code, details or code.name, _reason(trailers))
