"""``TeacherClient``: the blocking facade of the asyncio client core.

The client core (stream window, retries and fail-over, re-sending unanswered requests,
deadlines, recording) lives once, in the asyncio client; this class runs it on an event
loop of its own, in a background thread, and waits for each result. A stream's requests
are sent and its answers read on that loop while the caller works on the previous
payload, so prefetching goes on between calls to ``next``. A batch iterable given to
:meth:`TeacherClient.stream` is consumed on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any, Generic, Protocol, TypeVar

import torch
from typing_extensions import Unpack

from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.client_options import ClientOptions
from student_client.clients.window import Answer
from student_client.data.batch import (
    AnswerKeywords,
    LiveScoreKeywords,
    LiveStreamKeywords,
    split_device,
)
from student_client.data.payload import TeacherPayload
from topk_protocol import RequestOptions, TeacherInfo
from topk_protocol._closeable import Closeable
from topk_protocol.errors import TeacherError

__all__ = ["BlockingFacade", "TeacherClient"]

T = TypeVar("T")
AnswerT = TypeVar("AnswerT")
_DONE = object()  # the stream is exhausted


class _AsyncCore(Protocol[AnswerT]):
    """What :class:`BlockingFacade` needs of the asyncio client it runs: the answers of a
    stream (read on the loop) apart from their decoding (done in the caller's thread)."""

    async def info(self) -> Any: ...

    async def score(self, *args: Any, **kwargs: Any) -> TeacherPayload: ...

    def stream_answers(self, *args: Any, **kwargs: Any) -> AsyncIterator[AnswerT]: ...

    def decode(self, answer: AnswerT, device: torch.device | str) -> TeacherPayload: ...

    async def close(self) -> None: ...


class BlockingFacade(Closeable, Generic[AnswerT]):
    """Runs an asyncio client core on an event loop of its own, in a background thread,
    and waits for each result (:class:`TeacherClient`,
    :class:`~student_client.clients.multi_teacher.MultiTeacherClient`)."""

    def __init__(self, core: _AsyncCore[AnswerT]) -> None:
        self._core = core
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="teacher-client"
        )
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop and wait for its result."""
        if self._loop.is_closed():
            coro.close()
            raise TeacherError("client: already closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[LiveScoreKeywords],
    ) -> TeacherPayload:
        """Score one batch: see the asyncio client's ``score`` (same arguments; ``teacher``
        routes the sequences of a multi-teacher client, a single teacher ignores it)."""
        return self._run(self._core.score(sequences, top_k, **keywords))

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[LiveStreamKeywords],
    ) -> Iterator[TeacherPayload]:
        """Payloads of ``batches`` in input order, ``depth`` requests in flight: see the
        asyncio client's ``stream`` (same arguments)."""
        device, rest = split_device(keywords)
        answers = self.stream_answers(batches, top_k, **rest)

        def iterate() -> Iterator[TeacherPayload]:
            with contextlib.closing(answers):  # decoded here while the loop reads on
                for answer in answers:
                    yield self._core.decode(answer, device)

        return iterate()

    def stream_answers(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[AnswerKeywords],
    ) -> Generator[AnswerT, None, None]:
        """The complete answers to ``batches`` in input order, undecoded (:meth:`stream`
        decodes each one): for a caller that needs only that they arrived, such as a
        recorder whose client writes them (``record_to``)."""
        if self._loop.is_closed():
            raise TeacherError("client: already closed")
        answers = self._core.stream_answers(batches, top_k, **keywords)

        async def step() -> Any:
            return await anext(answers, _DONE)

        def iterate() -> Generator[AnswerT, None, None]:
            try:
                while (answer := self._run(step())) is not _DONE:
                    yield answer
            finally:
                if not self._loop.is_closed():
                    self._run(answers.aclose())  # type: ignore[attr-defined]

        return iterate()

    def close(self) -> None:
        """Close the channels, finish the recording (last rows flushed), stop the loop."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._core.close())
            self._run(self._loop.shutdown_asyncgens())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class TeacherClient(BlockingFacade[Answer]):
    """Blocking client of a ``topk_distill.v1.Teacher`` service.

    Takes the arguments of :class:`~student_client.clients.aio.AsyncTeacherClient`
    (``target``, ``token``, ``tls``, ``timeout_s``, ``retries``, ``record_to``, ...);
    :meth:`info`, :meth:`score` and :meth:`stream` behave as there, blocking.
    """

    def __init__(self, target: str | Sequence[str], **options: Unpack[ClientOptions]) -> None:
        self._aio = AsyncTeacherClient(target, **options)
        super().__init__(self._aio)

    @property
    def names(self) -> list[str]:
        """``[]``: one teacher (see :class:`~student_client.clients.sources.TeacherSource`)."""
        return []

    @property
    def targets(self) -> list[str]:
        return list(self._aio.targets)

    @property
    def current_target(self) -> str:
        """The target the latest call went to."""
        return self._aio.current_target

    def info(self) -> TeacherInfo:
        """The teacher's ``GetInfo`` (checked against the expected vocabulary)."""
        return self._run(self._aio.info())
