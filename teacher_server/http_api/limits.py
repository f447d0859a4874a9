"""Limits on what an HTTP client may make the teacher hold: header size, body size,
slow clients, connections. They apply to every route of the HTTP app.

uvicorn gives part of it: ``limit_concurrency`` (connections + requests at once; more
are answered 503), ``timeout_keep_alive`` (an idle kept-alive connection is closed) and,
with its h11 protocol, ``h11_max_incomplete_event_size`` (the largest request head
buffered). What it does not give is written here, each piece small:

- :class:`LimitedH11Protocol`: uvicorn's h11 protocol, answering a request head over the
  limit with **431** (uvicorn answers any parse error 400) and closing a connection
  whose request head has not arrived within ``header_timeout_s`` (slow-header clients,
  "slowloris": uvicorn has no such timeout). uvicorn's httptools protocol has no head
  size limit at all, so the server always uses this one.
- :class:`BodyLimitMiddleware`: an ASGI middleware that answers a body over
  ``max_body_bytes`` with **413** (from ``Content-Length`` before reading it, or as the
  chunks arrive) and one not received within ``body_timeout_s`` with **408**.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from teacher_server.config import HttpLimits

__all__ = ["BodyLimitMiddleware", "LimitedH11Protocol", "uvicorn_kwargs"]


def uvicorn_kwargs(limits: HttpLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments ``limits`` set."""
    return {
        "http": configure_header_timeout(limits.header_timeout_s),
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "limit_concurrency": limits.max_connections,
        "timeout_keep_alive": limits.keep_alive_s,
    }


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with 431 for a request head over the limit and a timeout
    for the request head (see the module docstring)."""

    #: Set on the class by :func:`configure_header_timeout` (uvicorn builds protocols
    #: itself, from its config, with no room for more arguments).
    header_timeout_s: float = HttpLimits.header_timeout_s

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None
        next_event = self.conn.next_event

        def watched_next_event() -> Any:
            try:
                event = next_event()
            except h11.RemoteProtocolError as e:
                self._head_too_large = e.error_status_hint == 431
                raise
            if isinstance(event, h11.Request):
                self._stop_head_timer()
            return event

        self.conn.next_event = watched_next_event  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_head_timer()  # the next request's head, if any, within the limit

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        # Still IDLE: no complete request head within the limit (uvicorn's keep-alive
        # timer covers a connection that sends nothing after a response; this one also
        # a head that trickles in).
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        body = b"request head (request line and headers) exceeds the server's limit\n"
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        # h11 refuses to send once the peer is in ERROR: write the response by hand.
        head = b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + b"".join(
            k + b": " + v + b"\r\n" for k, v in headers
        )
        self.transport.write(head + b"\r\n" + body)
        self.transport.close()


def configure_header_timeout(seconds: float) -> type[LimitedH11Protocol]:
    """A :class:`LimitedH11Protocol` subclass with this header timeout."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"header_timeout_s": seconds})


class BodyLimitMiddleware:
    """ASGI middleware: 413 for a body over ``max_body_bytes``, 408 for one that does not
    arrive within ``body_timeout_s``. Other scopes pass through."""

    def __init__(self, app: Any, *, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_body_bytes:
                    await _refuse(send, 413, self._too_large(declared))
                    return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received = 0
        refusal: _Refused | None = None
        response_started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, refusal
            try:
                message: dict[str, Any] = await asyncio.wait_for(
                    receive(), max(deadline - loop.time(), 0.0)
                )
            except TimeoutError:
                refusal = _Refused(408, f"body: not received within {self.body_timeout_s:g} s")
                raise refusal from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    refusal = _Refused(413, self._too_large(received))
                    raise refusal
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal response_started
            if refusal is not None and not response_started:
                return  # the app's answer to a refused body (e.g. a 500) is replaced
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception:
            if refusal is None or response_started:
                raise
        if refusal is not None and not response_started:
            await _refuse(send, refusal.status, refusal.message)

    def _too_large(self, n: int) -> str:
        return f"body: {n} bytes exceeds the limit of {self.max_body_bytes} (--http-max-body-mb)"


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
