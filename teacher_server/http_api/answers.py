"""An HTTP route's answer, and the one table from the request pipeline's status to HTTP.

The pipeline answers every request with a transport-free
:class:`~topk_protocol.codes.Status` (:mod:`teacher_server.pipeline`); every HTTP route
maps it here, once (:func:`http_status`), and renders a refusal in its own error shape
(:meth:`HTTPAnswer.refused` is the shape of our own routes and TRL's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from topk_protocol.codes import Status

__all__ = ["HTTPAnswer", "http_status"]

_HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400,
    Status.OUT_OF_RANGE: 400,
    Status.UNAUTHENTICATED: 401,
    Status.PERMISSION_DENIED: 403,
    Status.NOT_FOUND: 404,
    Status.RESOURCE_EXHAUSTED: 413,
    Status.UNAVAILABLE: 503,  # the clients (TRL's, slime's, ...) retry 5xx
    Status.DEADLINE_EXCEEDED: 504,
}


def http_status(code: Status) -> int:
    """The HTTP status of a refusal with status ``code`` (500 for the others)."""
    return _HTTP_STATUS.get(code, 500)


@dataclass(frozen=True)
class HTTPAnswer:
    """A route's answer: status and JSON body bytes."""

    status: int
    body: bytes

    @staticmethod
    def refused(code: Status, message: str) -> HTTPAnswer:
        """A refusal with status ``code``: its HTTP status (:func:`http_status`), body
        ``{"error": message, "code": "<status name>"}``."""
        body = {"error": message, "code": code.value}
        return HTTPAnswer(http_status(code), json.dumps(body).encode())
