"""Several named teachers, one student: route each sequence to its teacher service.

    from student_client.clients.multi_teacher import MultiTeacherClient

    with MultiTeacherClient({"math": "dns:///math:50051", "code": "h1:50051,h2:50051"}) as c:
        payload = c.score(seqs, 16, teacher=["math", "code", "code"])   # [B, S, K]
        payload.teachers                                                 # ('math', 'code', 'code')
        for p in c.stream([ScoreBatch(ids, attention_mask=m, teacher=names), ...], 16):
            ...

Each name is a full target of the one client core (:class:`AsyncTeacherClient`): its
own replicas, round robin, fail-over, retries, TLS and token. This module composes one
core per teacher and adds only the routing (:mod:`student_client.clients.routing`):

- at connect (the first call, or :meth:`AsyncMultiTeacherClient.connect`) every
  teacher's ``GetInfo`` is fetched and checked against ``expect_*`` and against the
  others (vocabulary size, tokenizer fingerprint, temperature); a mismatch is refused
  before any request, naming the teacher;
- a batch is split by teacher, the parts are scored concurrently (each by its teacher's
  core, which retries and fails over on its own: a slow or restarting teacher delays
  only its own parts), and the answers are put back in input order into one payload
  whose ``teachers`` names the teacher of each row;
- ``stream`` keeps ``depth`` batches in flight ahead of the one the caller holds
  (prefetch depth counts batches, whatever their teachers);
- ``record_to=DIR`` records each teacher's rows into ``DIR/<name>``
  (:mod:`topk_protocol.recording.multi_recording`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from typing_extensions import Unpack

from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import BlockingFacade
from student_client.clients.client_options import ClientOptions, ClientSettings
from student_client.clients.routing import check_agreement, merge_payloads, name_error, plan_routes
from student_client.clients.window import DecodedStream, as_async
from student_client.data.batch import (
    AnswerKeywords,
    LiveScoreKeywords,
    ScoreBatch,
    split_call,
    split_stream,
)
from student_client.data.payload import TeacherPayload
from topk_protocol import RequestOptions, TeacherInfo
from topk_protocol._closeable import AsyncCloseable
from topk_protocol.checks import check_depth
from topk_protocol.errors import TeacherError
from topk_protocol.recording.multi_recording import (
    check_teacher_name,
    teacher_recording_path,
    write_manifest,
)

__all__ = ["AsyncMultiTeacherClient", "MultiTeacherClient", "RoutedAnswer"]

#: A teacher: a target (``"host:port"``, ``"dns:///..."``, ``"h1:p,h2:p"`` or a list),
#: or a dict ``{"target": ..., **AsyncTeacherClient options}`` (its own token, TLS, ...).
TeacherSpec = str | Sequence[str] | Mapping[str, Any]
#: Options that apply to every teacher's recording or expectations: set them once.
_SHARED_ONLY = (
    "record_to",
    "record_compression",
    "record_metadata",
    "expect_vocab_size",
    "expect_tokenizer_fingerprint",
    "expect_temperature",
)


@dataclass(frozen=True)
class RoutedAnswer:
    """The complete answer to one routed batch: each route's rows and payload (on the
    CPU), and the teacher of every row; :meth:`AsyncMultiTeacherClient.decode` merges it."""

    parts: list[tuple[list[int], TeacherPayload]]
    teachers: list[str]


class AsyncMultiTeacherClient(AsyncCloseable, DecodedStream[RoutedAnswer]):
    """asyncio client over named teachers (see the module docstring).

    Args:
        teachers: ``{name: target or {"target": ..., options}}``; names as
            :func:`~topk_protocol.recording.multi_recording.check_teacher_name` allows.
        expect_vocab_size, expect_tokenizer_fingerprint, expect_temperature: checked
            against every teacher (and every replica) before its first request.
        record_to: record each teacher's answered rows into ``record_to/<name>``.
        record_compression, record_metadata: as :class:`AsyncTeacherClient`.
        student_tokenizer: as :class:`AsyncTeacherClient`, for every teacher (a teacher's
            own dict may name it differently: each teacher's ``--student-tokenizer``
            names its own).
        **options: :class:`AsyncTeacherClient` options for every teacher (``token``,
            ``tls``, ``timeout_s``, ``retries``, ``backoff_s``, ...); a teacher's own dict
            overrides them.
    """

    def __init__(
        self, teachers: Mapping[str, TeacherSpec], **options: Unpack[ClientOptions]
    ) -> None:
        if not isinstance(teachers, Mapping) or not teachers:
            raise ValueError("teachers: expected a non-empty {name: target} mapping")
        self.names = [check_teacher_name(n) for n in teachers]
        settings = ClientSettings(**options)  # checked once, for every teacher
        record_to = settings.record_to
        self._clients: dict[str, AsyncTeacherClient] = {}
        for name, spec in teachers.items():
            own: dict[str, Any] = dict(spec) if isinstance(spec, Mapping) else {"target": spec}
            if "target" not in own:
                raise ValueError(f"teachers[{name!r}]: a dict needs 'target'")
            clash = [k for k in _SHARED_ONLY if k in own]
            if clash:
                raise ValueError(
                    f"teachers[{name!r}]: {clash} apply to every teacher; pass them once"
                )
            target = own.pop("target")
            recording = None if record_to is None else teacher_recording_path(record_to, name)
            try:
                teacher = replace(
                    settings,
                    **own,
                    record_to=recording,
                    record_metadata={**(settings.record_metadata or {}), "teacher": name},
                )
                self._clients[name] = AsyncTeacherClient(target, **teacher.keywords())
            except ValueError as e:
                raise ValueError(f"teachers[{name!r}]: {e}") from None
        if record_to is not None:
            write_manifest(record_to, self.names)
        self._infos: dict[str, TeacherInfo] | None = None
        self._connecting: asyncio.Lock | None = None

    @property
    def targets(self) -> dict[str, list[str]]:
        """Each teacher's targets."""
        return {n: list(c.targets) for n, c in self._clients.items()}

    @property
    def current_target(self) -> dict[str, str]:
        """The target each teacher's latest call went to."""
        return {n: c.current_target for n, c in self._clients.items()}

    def client(self, name: str) -> AsyncTeacherClient:
        """The core of teacher ``name``."""
        if name not in self._clients:
            raise KeyError(f"teacher: {name!r} is not one of {self.names}")
        return self._clients[name]

    # -- connect -----------------------------------------------------------------------
    async def connect(self) -> dict[str, TeacherInfo]:
        """Fetch and check every teacher's ``GetInfo`` (once): each against ``expect_*``
        and all against each other (:func:`~student_client.clients.routing.check_agreement`)."""
        if self._infos is not None:
            return self._infos
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._infos is None:
                infos = await self._gather({n: c.info() for n, c in self._clients.items()})
                check_agreement(infos, self.targets)
                self._infos = infos
        return self._infos

    async def info(self) -> dict[str, TeacherInfo]:
        """Every teacher's ``GetInfo``, checked (see :meth:`connect`)."""
        return await self.connect()

    async def _gather(self, calls: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``{name: coroutine}`` concurrently; the first failure cancels the rest and
        is raised with the teacher's name in its message."""

        async def named(name: str, coro: Any) -> Any:
            try:
                return await coro
            except TeacherError as e:
                raise name_error(name, e) from None

        tasks = {n: asyncio.ensure_future(named(n, c)) for n, c in calls.items()}
        try:
            await asyncio.gather(*tasks.values())
        except BaseException:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        return {n: t.result() for n, t in tasks.items()}

    # -- score -------------------------------------------------------------------------
    async def _answer(
        self, item: ScoreBatch, options: RequestOptions, timeout_s: float | None
    ) -> RoutedAnswer:
        """Score one batch: its routes concurrently, each by its teacher's core."""
        await self.connect()
        teachers, routes = plan_routes(item, self.names)
        calls = {
            r.teacher: self._clients[r.teacher].score(
                r.batch.sequences,
                item.request_options(options),
                positions=r.batch.positions,
                attention_mask=r.batch.attention_mask,
                timeout_s=timeout_s,
                candidate_ids=r.batch.candidate_ids,
            )
            for r in routes
        }
        done = await self._gather(calls)
        return RoutedAnswer([(r.rows, done[r.teacher]) for r in routes], teachers)

    def decode(self, answer: RoutedAnswer, device: torch.device | str) -> TeacherPayload:
        """A routed answer as one payload in input order (``teachers`` set), on ``device``."""
        payload = merge_payloads(answer.parts, answer.teachers)
        return payload if str(device) == "cpu" else payload.to(device)

    async def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[LiveScoreKeywords],
    ) -> TeacherPayload:
        """Score one batch, each sequence by its ``teacher`` (a name per sequence, one
        name, or indices into :attr:`names`); the other arguments (the request options:
        ``top_k`` or a :class:`~topk_protocol.RequestOptions`, and keywords;
        ``candidate_ids``) and the ``[B, S, K]`` payload as
        :meth:`AsyncTeacherClient.score`, with ``payload.teachers`` set."""
        call = split_call(sequences, keywords)
        opts = RequestOptions.of(top_k, **call.options)
        return self.decode(await self._answer(call.batch, opts, call.timeout_s), call.device)

    # -- stream ------------------------------------------------------------------------
    def stream_answers(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[AnswerKeywords],
    ) -> AsyncIterator[RoutedAnswer]:
        """The answers to ``batches`` (:class:`ScoreBatch` items with ``teacher``; plain
        batches only with a single teacher), in input order, with ``depth`` batches in
        flight ahead of the one the caller holds. A batch that failed raises (its
        teacher named) when the caller reaches it, which ends the iteration. ``top_k``
        and the request ``options``: as :meth:`AsyncTeacherClient.stream_answers`."""
        call = split_stream(keywords)
        check_depth(call.depth)
        opts = RequestOptions.of(top_k, **call.options)
        return self._run_stream(as_async(batches), opts, call.depth, call.timeout_s)

    async def _run_stream(
        self,
        source: AsyncIterator[Any],
        options: RequestOptions,
        depth: int,
        timeout_s: float | None,
    ) -> AsyncIterator[RoutedAnswer]:
        window: deque[asyncio.Future[RoutedAnswer]] = deque()
        exhausted = False

        async def fill(limit: int) -> None:
            nonlocal exhausted
            while not exhausted and len(window) < limit:
                batch = await anext(source, None)
                if batch is None:
                    exhausted = True
                    return
                item = batch if isinstance(batch, ScoreBatch) else ScoreBatch(batch)
                window.append(asyncio.ensure_future(self._answer(item, options, timeout_s)))

        try:
            await self.connect()
            while True:
                await fill(depth + 1)  # the caller's next batch and ``depth`` ahead
                if not window:
                    return
                answer = await window.popleft()
                yield answer
        finally:
            for task in window:
                task.cancel()
            for task in window:
                with contextlib.suppress(BaseException):
                    await task

    # -- lifecycle ---------------------------------------------------------------------
    async def close(self) -> None:
        """Close every teacher's channels and recording."""
        for c in self._clients.values():
            await c.close()


class MultiTeacherClient(BlockingFacade[RoutedAnswer]):
    """Blocking client over named teachers: :class:`AsyncMultiTeacherClient` run on a
    background event loop (:class:`~student_client.clients.blocking.BlockingFacade`).

    :meth:`score` and :meth:`stream` take and give what the asyncio client's do
    (``teacher=``, :class:`ScoreBatch` with ``teacher``); :meth:`info` returns
    ``{name: TeacherInfo}``.
    """

    def __init__(
        self, teachers: Mapping[str, TeacherSpec], **options: Unpack[ClientOptions]
    ) -> None:
        self._aio = AsyncMultiTeacherClient(teachers, **options)
        super().__init__(self._aio)

    @property
    def names(self) -> list[str]:
        return list(self._aio.names)

    @property
    def targets(self) -> dict[str, list[str]]:
        return self._aio.targets

    @property
    def current_target(self) -> dict[str, str]:
        return self._aio.current_target

    def info(self) -> dict[str, TeacherInfo]:
        """Every teacher's ``GetInfo``, checked (see :meth:`connect`)."""
        return self._run(self._aio.info())

    def connect(self) -> dict[str, TeacherInfo]:
        """Fetch and check every teacher's ``GetInfo`` now (else: at the first call)."""
        return self._run(self._aio.connect())
