"""One HTTP request body through the request pipeline, whatever the route's layout.

Every route that answers another server's call (TRL's, vLLM's, SGLang's) is a ``parse``
(the body's bytes and the teacher's ``TeacherInfo`` -> the route's typed request, which
builds one ``ScoreRequest``), a ``render`` (that request and the scored sequences -> the
answer's bytes) and a ``refuse`` (a refusal -> the route's own error shape). The body is
parsed, and its answer rendered, in a worker thread (the probes share the serving loop);
the request goes through :meth:`~teacher_server.pipeline.RequestPipeline.run` like a
gRPC ``Score``: lifecycle (503 while loading or draining), validation with the same
limits and words, admission in turn per client (its bearer token or address), the
backend, metrics under the route's ``method``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from fastapi import Request

from teacher_server.fair_share import client_identity
from teacher_server.http_api.answers import HTTPAnswer
from teacher_server.http_api.bodies import IgnoredField
from teacher_server.pipeline import Refused, RequestPipeline
from teacher_server.validation import Limits, ParsedRequest
from topk_protocol import SequenceArrays, pb
from topk_protocol.errors import TeacherUnavailableError

__all__ = ["RouteRequest", "http_client", "score_body"]

logger = logging.getLogger(__name__)


class RouteRequest(Protocol):
    """A route's parsed request: the one ``ScoreRequest`` it is scored as, and the body
    fields it accepted and ignored (:class:`~teacher_server.http_api.bodies.FieldRules`)."""

    @property
    def ignored_fields(self) -> tuple[IgnoredField, ...]: ...

    def score_request(self) -> pb.ScoreRequest: ...


P = TypeVar("P", bound=RouteRequest)


async def score_body(
    pipeline: RequestPipeline,
    info: Callable[[], pb.TeacherInfo | None],
    method: str,
    body: bytes,
    parse: Callable[[bytes, pb.TeacherInfo, Limits], P],
    render: Callable[[P, list[SequenceArrays], float], bytes],
    refuse: Callable[[Refused], HTTPAnswer],
    client: Hashable = None,
) -> HTTPAnswer:
    """The route's answer to ``body``: ``render(parsed, scored, teacher seconds)`` with
    status 200, or ``refuse(refusal)``. ``client`` names the caller's turn in admission
    (None: an anonymous turn of its own)."""
    parsed: list[P] = []  # the body, once read (in a worker thread)

    def read() -> pb.ScoreRequest:
        served = info()
        if served is None:
            raise TeacherUnavailableError("teacher: loading")
        parsed.append(parse(body, served, pipeline.limits))
        for field in parsed[0].ignored_fields:
            if pipeline.metrics.count_ignored_field(method, field.path, field.label):
                logger.info(
                    "%s: field %r accepted and ignored, as the stock server ignores it "
                    "(logged once; counted in topk_teacher_http_ignored_fields_total)",
                    method,
                    field.path,
                )
        return parsed[0].score_request()

    def finish(_: ParsedRequest, scored: list[SequenceArrays], seconds: float) -> bytes:
        return render(parsed[0], scored, seconds)

    outcome = await pipeline.run(method, read, finish, finish_in_thread=True, turn=(client, None))
    if isinstance(outcome, Refused):
        return refuse(outcome)
    return HTTPAnswer(200, outcome.answer)


def http_client(request: Request) -> str:
    """The caller's identity for admission turns: its bearer token and host, as gRPC's
    (:func:`~teacher_server.fair_share.client_identity`)."""
    peer = f"http:{request.client.host}:{request.client.port}" if request.client else None
    return client_identity(request.headers.get("authorization"), peer)
