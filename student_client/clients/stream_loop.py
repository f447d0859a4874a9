"""The stream loop of :class:`~student_client.clients.aio.AsyncTeacherClient`.

:func:`run_stream` keeps up to ``depth`` requests in flight on one ``ScoreStream``
(:class:`~student_client.clients.window.StreamWindow` holds them in order), yields their
complete answers in input order, records each one, and on a lost connection (or an
UNAVAILABLE refusal) reconnects with backoff, to the next target when there are several,
and sends the unanswered requests again: a batch is neither lost nor yielded twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import grpc

from student_client.clients.agreement import ReplicaDisagreesError
from student_client.clients.channels import give_up
from student_client.clients.window import (
    END,
    Answer,
    Connection,
    Outgoing,
    RetryStream,
    StreamWindow,
)
from topk_protocol.errors import DeadlineExceededError, TeacherError, TeacherUnavailableError
from topk_protocol.status import error_from_rpc

if TYPE_CHECKING:
    from student_client.clients.aio import AsyncTeacherClient

__all__ = ["run_stream"]


async def run_stream(
    self: AsyncTeacherClient,
    requests: AsyncIterator[Outgoing | TeacherError],
    depth: int,
    timeout_s: float,
) -> AsyncGenerator[Answer, None]:
    """The answers to ``requests`` in order, ``depth`` of them in flight on one
    ``ScoreStream`` of ``self`` (a failed one raised when reached); on a lost connection
    or UNAVAILABLE the unanswered ones are sent again, to the next target, with backoff;
    ``timeout_s`` counts per request from when it is sent."""
    window = StreamWindow()
    index = next(self._rr) % len(self.targets)
    conn: Connection | None = None
    exhausted = False
    failures = 0

    async def fill(conn: Connection, limit: int) -> None:
        nonlocal exhausted
        while not exhausted and len(window) < limit:
            request = await anext(requests, None)
            exhausted = request is None
            if isinstance(request, TeacherError):
                window.add_failed(request)
            elif request is not None:
                window.add(*request)
                await conn.send(request[0])

    try:
        while True:
            if conn is None:
                if failures:
                    await asyncio.sleep(self._wait(failures))
                    index = (index + 1) % len(self.targets)
                self._current = index = await self._pick(index)
                try:
                    await self._fetch_info(index)
                except ReplicaDisagreesError:
                    continue  # refused now: _pick moves on
                except grpc.RpcError as e:
                    failures += 1
                    give_up(failures, self._tries, error_from_rpc(e), self.targets)
                    continue
                conn = Connection(self._stub(index), self._metadata)
                for pending in window.unanswered():
                    await conn.send(pending.request)
            await fill(conn, max(depth, 1))
            if not window:
                return
            head = window.head()
            if head.assembler.complete:
                window.pop()
                if head.assembler.error is not None:
                    raise head.assembler.error
                await fill(conn, depth)
                self._record_answer(index, head.assembler)
                yield Answer(head.assembler, head.layout)
                continue
            try:
                item = await conn.get(head.sent_at + timeout_s - time.monotonic())
            except TimeoutError:
                raise DeadlineExceededError(
                    f"request {head.request.request_id}: no complete answer within "
                    f"timeout_s {timeout_s} s",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ) from None
            if isinstance(item, grpc.RpcError):
                last = error_from_rpc(item)
            elif item is END:
                last = TeacherUnavailableError("the teacher closed the stream early")
            else:
                try:
                    if window.route(item):
                        failures = 0
                    continue
                except RetryStream as e:
                    last = e.error
            # Connection lost (or the teacher refused with UNAVAILABLE): reconnect.
            failures += 1
            give_up(failures, self._tries, last, self.targets)
            await conn.close()
            conn = None
    finally:
        if conn is not None:
            await conn.close()
