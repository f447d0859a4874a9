"""The stream loop of :class:`~student_client.clients.aio.AsyncTeacherClient`.

:class:`StreamLoop` keeps up to ``depth`` requests in flight on one ``ScoreStream``
(:class:`~student_client.clients.window.StreamWindow` holds them in order), yields their
complete answers in input order, records each one, and on a lost connection (or an
UNAVAILABLE refusal) reconnects with backoff, to the next target when there are several,
and sends the unanswered requests again: a batch is neither lost nor yielded twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from student_client.clients.agreement import ReplicaDisagreesError
from student_client.clients.targets import TargetSet
from student_client.clients.window import (
    END,
    Answer,
    Connection,
    Outgoing,
    Pending,
    RetryStream,
    StreamWindow,
)
from student_client.data.assembler import ResponseAssembler
from topk_protocol import pb
from topk_protocol.errors import DeadlineExceededError, TeacherError, TeacherUnavailableError
from topk_protocol.status import error_from_rpc

__all__ = ["StreamLoop"]


class StreamLoop:
    """Runs ``ScoreStream`` calls on ``targets`` (their retry policy, their checked
    ``GetInfo``), handing each answer to ``on_answer(target_index, assembler)`` (the
    client's recording) before it is yielded."""

    def __init__(
        self, targets: TargetSet, on_answer: Callable[[int, ResponseAssembler], None]
    ) -> None:
        self._targets = targets
        self._on_answer = on_answer

    async def _connect(self, index: int, failures: int) -> tuple[int, Connection | None, int]:
        """A stream to target ``index``, or to the next one after ``failures`` failed
        tries (waiting first): the target, the connection (None: not this time, try
        again) and the failed tries now (one more where ``GetInfo`` failed retryably;
        a failure not worth a retry, or the last try, is raised)."""
        targets = self._targets
        if failures:
            await asyncio.sleep(targets.retry.wait_s(failures))
            index = (index + 1) % len(targets.targets)
        targets.current = index = await targets.pick(index)
        try:
            await targets.fetch_info(index)
        except ReplicaDisagreesError:
            return index, None, failures  # refused now: pick moves on
        except grpc.RpcError as e:
            targets.retry.give_up(failures + 1, error_from_rpc(e), targets.targets)
            return index, None, failures + 1
        return index, Connection(targets.stub(index), targets.connecting.metadata), failures

    async def run(
        self,
        requests: AsyncIterator[Outgoing | TeacherError],
        depth: int,
        timeout_s: float,
    ) -> AsyncGenerator[Answer, None]:
        """The answers to ``requests`` in order, ``depth`` of them in flight on one
        ``ScoreStream`` (a failed one raised when reached); on a lost connection or
        UNAVAILABLE the unanswered ones are sent again, to the next target, with backoff;
        ``timeout_s`` counts per request from when it is sent."""
        window = StreamWindow()
        index = self._targets.next_index()
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
                    index, conn, failures = await self._connect(index, failures)
                    if conn is None:
                        continue
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
                    self._on_answer(index, head.assembler)
                    yield Answer(head.assembler, head.layout)
                    continue
                item = await _next_item(conn, head.sent_at + timeout_s, head, timeout_s)
                if not isinstance(item, TeacherError):
                    try:
                        if window.route(item):
                            failures = 0
                        continue
                    except RetryStream as e:
                        item = e.error
                # Connection lost (or the teacher refused with UNAVAILABLE): reconnect.
                failures += 1
                self._targets.retry.give_up(failures, item, self._targets.targets)
                await conn.close()
                conn = None
        finally:
            if conn is not None:
                await conn.close()


async def _next_item(
    conn: Connection, deadline: float, head: Pending, timeout_s: float
) -> pb.ScoreResponse | TeacherError:
    """The next message on ``conn`` before ``deadline`` (monotonic seconds), or the
    ``TeacherError`` the stream ended with; past it, ``DeadlineExceededError`` naming
    ``head``'s request."""
    try:
        item = await conn.get(deadline - time.monotonic())
    except TimeoutError:
        raise DeadlineExceededError(
            f"request {head.request.request_id}: no complete answer within timeout_s {timeout_s} s",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ) from None
    if isinstance(item, grpc.RpcError):
        return error_from_rpc(item)
    if item is END:
        return TeacherUnavailableError("the teacher closed the stream early")
    response: pb.ScoreResponse = item
    return response
