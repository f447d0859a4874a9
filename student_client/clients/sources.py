"""The one interface every teacher client satisfies, blocking and asyncio.

:class:`TeacherSource` is what a training loop, the Hugging Face Trainer
(:mod:`student_client.integrations.hf_trainer`), the examples and ``teacher-record`` use
of a teacher: the blocking :class:`~student_client.clients.blocking.TeacherClient`, the
:class:`~student_client.clients.multi_teacher.MultiTeacherClient`, and the recordings'
:class:`~student_client.offline.replay_client.ReplayClient` and
:class:`~student_client.offline.multi_replay.MultiReplayClient` all satisfy it.
:class:`AsyncTeacherSource` is the same interface on asyncio
(:class:`~student_client.clients.aio.AsyncTeacherClient`,
:class:`~student_client.clients.multi_teacher.AsyncMultiTeacherClient`). mypy checks every class
against its protocol (:mod:`student_client.offline.conformance`).

``names`` tells a single-teacher source (``[]``) from a multi-teacher one (its teachers'
names, routed per sequence by ``teacher=`` / :attr:`ScoreBatch.teacher
<student_client.data.batch.ScoreBatch.teacher>`); ``info`` gives one
:class:`~topk_protocol.TeacherInfo`, or ``{name: TeacherInfo}`` for several teachers.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from typing_extensions import Unpack

from student_client.data.batch import ScoreKeywords, StreamKeywords
from student_client.data.payload import TeacherPayload
from topk_protocol import RequestOptions, TeacherInfo

__all__ = ["AsyncTeacherSource", "TeacherSource"]

#: ``info()``'s answer: one teacher's, or each named teacher's.
InfoAnswer = TeacherInfo | Mapping[str, TeacherInfo]


@runtime_checkable
class TeacherSource(Protocol):
    """A blocking source of teacher payloads (a live teacher, several, or a recording).

    ``score`` answers one batch (``[B, S, K]``, :class:`TeacherPayload`); ``stream``
    answers an iterable of batches in input order (``depth`` ahead where there is
    something to prefetch); ``close`` releases channels, recordings and files.
    """

    @property
    def names(self) -> list[str]:
        """The teachers' names (``[]``: a single teacher)."""
        ...

    def info(self) -> InfoAnswer:
        """The teacher's ``GetInfo`` (``{name: TeacherInfo}`` for several)."""
        ...

    def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[ScoreKeywords],
    ) -> TeacherPayload:
        """Score one batch (``positions``, ``attention_mask``, ``teacher``, ``device`` and
        the request options by keyword)."""
        ...

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[StreamKeywords],
    ) -> Iterator[TeacherPayload]:
        """Payloads of ``batches`` (batches or :class:`ScoreBatch` items), in order."""
        ...

    def close(self) -> None:
        """Release everything the source holds (idempotent)."""
        ...


@runtime_checkable
class AsyncTeacherSource(Protocol):
    """:class:`TeacherSource` on asyncio: ``info``, ``score`` and ``close`` are coroutines
    and ``stream`` an async iterator."""

    @property
    def names(self) -> list[str]:
        """The teachers' names (``[]``: a single teacher)."""
        ...

    async def info(self) -> InfoAnswer:
        """The teacher's ``GetInfo`` (``{name: TeacherInfo}`` for several)."""
        ...

    async def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[ScoreKeywords],
    ) -> TeacherPayload:
        """Score one batch (see :meth:`TeacherSource.score`)."""
        ...

    def stream(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[StreamKeywords],
    ) -> AsyncIterator[TeacherPayload]:
        """Payloads of ``batches``, in order, ``depth`` requests ahead."""
        ...

    async def close(self) -> None:
        """Release everything the source holds (idempotent)."""
        ...
