"""The requests in flight of a teacher client: the stream window (``depth`` requests on one
``ScoreStream``, answers routed back in order), one connection's reader, and the answers
as the client hands them on."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import torch
from typing_extensions import Unpack

from student_client.clients.channels import is_retryable
from student_client.data.alignment import PaddedLayout
from student_client.data.assembler import ResponseAssembler
from student_client.data.batch import AnswerKeywords, LiveStreamKeywords, split_device
from student_client.data.payload import TeacherPayload
from topk_protocol import (
    RequestOptions,
    pb,
    pb_grpc,
)
from topk_protocol.errors import (
    TeacherError,
)

__all__ = [
    "END",
    "Answer",
    "Connection",
    "DecodedStream",
    "Outgoing",
    "Pending",
    "RetryStream",
    "StreamWindow",
    "as_async",
    "decoded",
]

END = object()  # the server closed the stream
#: What a core's ``stream_answers`` yields (``Answer``, or a multi-teacher ``RoutedAnswer``).
AnswerT = TypeVar("AnswerT")
#: A request to send, the padded layout its answer goes back into (None: unpadded) and
#: the options it was built with (handed to its assembler and recording, not re-derived).
Outgoing = tuple[pb.ScoreRequest, PaddedLayout | None, RequestOptions]


@dataclass(frozen=True, slots=True)
class Answer:
    """The complete answer to one request, and where its rows go back: the batch's padded
    ``[B, T]`` layout (None: the batch came unpadded). :meth:`AsyncTeacherClient.decode`
    turns it into a :class:`TeacherPayload`."""

    response: ResponseAssembler
    layout: PaddedLayout | None = None


@dataclass(slots=True)
class Pending:
    """A request of a stream that has been sent and not yet handed to the caller."""

    assembler: ResponseAssembler
    layout: PaddedLayout | None = None
    sent_at: float = field(default_factory=time.monotonic)

    @property
    def request(self) -> pb.ScoreRequest:
        return self.assembler.request


class RetryStream(Exception):
    """Internal: a request was refused with UNAVAILABLE inside a stream (server loading or
    draining); reconnect and re-send."""

    def __init__(self, error: TeacherError) -> None:
        super().__init__(error.message)
        self.error = error


class StreamWindow:
    """The requests of one logical stream that are sent and not yet yielded, in order.

    Sans-IO: the stream loop feeds it server messages with :meth:`route` and takes
    completed requests from the head with :meth:`pop`.
    """

    def __init__(self) -> None:
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._local = itertools.count()

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self,
        request: pb.ScoreRequest,
        layout: PaddedLayout | None = None,
        options: RequestOptions | None = None,
    ) -> Pending:
        """Take a sent request (``options``: the ones it was built with)."""
        if request.request_id in self._pending:
            raise TeacherError(f"request_id: {request.request_id!r} is already in flight")
        pending = Pending(ResponseAssembler(request, options), layout)
        self._pending[request.request_id] = pending
        return pending

    def add_failed(self, error: TeacherError) -> None:
        """A batch refused before sending: it fails when the caller reaches it."""
        request = pb.ScoreRequest(request_id=f"!local-{next(self._local)}", top_k=1)
        pending = Pending(ResponseAssembler(request))
        pending.assembler.error = error
        pending.assembler.complete = True
        self._pending[pending.request.request_id] = pending

    def head(self) -> Pending:
        return next(iter(self._pending.values()))

    def pop(self) -> Pending:
        return self._pending.popitem(last=False)[1]

    def route(self, msg: pb.ScoreResponse) -> bool:
        """Take one server message; True when it completed a request."""
        pending = self._pending.get(msg.request_id)
        if pending is None:
            raise TeacherError(
                f"teacher answered request_id {msg.request_id!r}, which is not in flight"
            )
        pending.assembler.add(msg)
        err = pending.assembler.error
        if err is not None and is_retryable(err):
            pending.assembler.reset()
            raise RetryStream(err)
        return pending.assembler.complete

    def unanswered(self) -> list[Pending]:
        """Requests not completely answered, in order, reset for sending again."""
        out = [p for p in self._pending.values() if not p.assembler.complete]
        for p in out:
            p.assembler.reset()
            p.sent_at = time.monotonic()
        return out


class Connection:
    """One ``ScoreStream`` call: ``send`` writes, a task reads answers into a queue."""

    def __init__(self, stub: pb_grpc.TeacherStub, metadata: Sequence[tuple[str, str]]) -> None:
        self._call = stub.ScoreStream(metadata=metadata)
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                self._out.put_nowait(msg)
            self._out.put_nowait(END)
        except grpc.RpcError as e:
            self._out.put_nowait(e)

    async def send(self, request: pb.ScoreRequest) -> None:
        with contextlib.suppress(Exception):  # the call is over; the reader reports why
            await self._call.write(request)

    async def get(self, timeout: float) -> Any:
        """The next server message, ``END`` or a ``grpc.RpcError``; TimeoutError."""
        return await asyncio.wait_for(self._out.get(), max(timeout, 0.0))

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


async def decoded(
    answers: AsyncIterator[Any],
    decode: Callable[[Any, torch.device | str], TeacherPayload],
    device: torch.device | str,
) -> AsyncIterator[TeacherPayload]:
    """``answers`` (of ``stream_answers``) decoded one by one on ``device``; closing this
    iterator closes ``answers``."""
    try:
        async for answer in answers:
            yield decode(answer, device)
    finally:
        await answers.aclose()  # type: ignore[attr-defined]


class DecodedStream(Generic[AnswerT]):
    """``stream`` of an asyncio client core, written once: the core's ``stream_answers``
    decoded on the loop by its ``decode`` (:class:`~student_client.clients.aio.
    AsyncTeacherClient`, :class:`~student_client.clients.multi_teacher.AsyncMultiTeacherClient`)."""

    def stream(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[LiveStreamKeywords],
    ) -> AsyncIterator[TeacherPayload]:
        """Payloads of ``batches``, in input order, with ``depth`` requests in flight, on
        ``device``; ``depth``, ``timeout_s`` and the request options (``dtype``,
        ``include_sampled``, ...) as ``stream_answers``."""
        device, rest = split_device(keywords)
        return decoded(self.stream_answers(batches, top_k, **rest), self.decode, device)

    def stream_answers(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[AnswerKeywords],
    ) -> AsyncIterator[AnswerT]:
        """The complete answers to ``batches``, in input order, undecoded."""
        raise NotImplementedError

    def decode(self, answer: AnswerT, device: torch.device | str) -> TeacherPayload:
        """One complete answer's payload on ``device``."""
        raise NotImplementedError


async def as_async(batches: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(batches, AsyncIterable):
        async for b in batches:
            yield b
    else:
        for b in batches:
            yield b
