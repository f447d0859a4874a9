"""``AsyncTeacherClient``: the asyncio twin of :class:`student_client.client.TeacherClient`.

Same arguments, same behaviour (targets, retries, deadlines, typed exceptions, the
stream window, recording); ``info``, ``score`` and ``close`` are coroutines and
``stream`` is an async iterator that also accepts an async iterable of batches.
Channels are opened on first use, inside the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Sequence,
)
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import torch

from student_client.client import (
    _END,
    _ClientCore,
    _is_retryable,
    _RetryStream,
    _StreamWindow,
    request_from_batch,
)
from student_client.errors import (
    DeadlineExceededError,
    TeacherError,
    TeacherUnavailableError,
    error_from_rpc,
)
from student_client.payload import ResponseAssembler, TeacherInfo, TeacherPayload, build_request
from student_client.wire import pb, pb_grpc

__all__ = ["AsyncTeacherClient"]

T = TypeVar("T")


class _AsyncStream:
    """One ``ScoreStream`` call: ``send`` writes, a task reads answers into a queue."""

    def __init__(self, stub: pb_grpc.TeacherStub, metadata: Sequence[tuple[str, str]]) -> None:
        self._call = stub.ScoreStream(metadata=metadata)
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    self._out.put_nowait(_END)
                    return
                self._out.put_nowait(msg)
        except grpc.RpcError as e:
            self._out.put_nowait(e)

    async def send(self, request: pb.ScoreRequest) -> None:
        try:
            await self._call.write(request)
        except Exception:  # the call is over; the reader reports its status
            return

    async def get(self, timeout: float) -> Any:
        """The next server message, ``_END`` or a ``grpc.RpcError``; TimeoutError."""
        return await asyncio.wait_for(self._out.get(), max(timeout, 0.0))

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


async def _as_async(batches: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(batches, AsyncIterable):
        async for b in batches:
            yield b
    else:
        for b in batches:
            yield b


class AsyncTeacherClient:
    """asyncio client of a ``topk_distill.v1.Teacher`` service.

    Arguments as :class:`student_client.client.TeacherClient`.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        tls: bool | bytes | str | Path | None = None,
        tls_server_name: str | None = None,
        timeout_s: float = 120.0,
        max_message_mb: int = 64,
        retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        expect_vocab_size: int | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        record_to: str | Path | None = None,
        record_compression: str = "auto",
        record_metadata: dict[str, Any] | None = None,
    ) -> None:
        self._core = _ClientCore(
            target,
            token=token,
            tls=tls,
            tls_server_name=tls_server_name,
            timeout_s=timeout_s,
            max_message_mb=max_message_mb,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            expect_vocab_size=expect_vocab_size,
            expect_tokenizer_fingerprint=expect_tokenizer_fingerprint,
            record_to=record_to,
            record_compression=record_compression,
            record_metadata=record_metadata,
        )
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.TeacherStub] = []
        self._info_msgs: dict[int, pb.TeacherInfo] = {}
        self._closed = False

    @property
    def targets(self) -> list[str]:
        return list(self._core.targets)

    @property
    def current_target(self) -> str:
        return self._core.targets[self._core.current]

    def _stub(self, index: int) -> pb_grpc.TeacherStub:
        if self._closed:
            raise TeacherError("client: already closed")
        if not self._stubs:
            core = self._core
            for t in core.targets:
                opts = core.channel_options(t)
                if core.credentials is None:
                    channel = grpc.aio.insecure_channel(t, options=opts)
                else:
                    channel = grpc.aio.secure_channel(t, core.credentials, options=opts)
                self._channels.append(channel)
                self._stubs.append(pb_grpc.TeacherStub(channel))
        return self._stubs[index]

    async def _fetch_info(self, index: int) -> TeacherInfo:
        core = self._core
        if index not in core.infos:
            msg = await self._stub(index).GetInfo(
                pb.GetInfoRequest(), timeout=core.timeout_s, metadata=core.metadata
            )
            info = TeacherInfo.from_message(msg)
            core.check_info(info, core.targets[index])
            self._info_msgs[index] = msg
            core.infos[index] = info
        return core.infos[index]

    async def _call(self, fn: Callable[[int], Awaitable[T]], index: int | None = None) -> T:
        core = self._core
        index = core.next_target() if index is None else index
        last: TeacherError | None = None
        for attempt in range(core.tries):
            core.current = index
            try:
                return await fn(index)
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not _is_retryable(err):
                    raise err from None
                last = err
            if attempt + 1 < core.tries:
                await asyncio.sleep(core.backoff(attempt))
                index = core.fail_over(index)
        assert last is not None
        raise core.unavailable(core.tries, last)

    async def info(self) -> TeacherInfo:
        """The teacher's ``GetInfo`` (checked against the expected vocabulary)."""
        return await self._call(self._fetch_info, self._core.current)

    async def score(
        self,
        sequences: Any,
        top_k: int,
        *,
        dtype: str = "float16",
        positions: Sequence[tuple[int, int]] | None = None,
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> TeacherPayload:
        """Score one batch (see :meth:`TeacherClient.score`)."""
        core = self._core
        timeout = core.call_timeout(timeout_s)
        request = build_request(
            sequences,
            top_k,
            dtype=dtype,
            positions=positions,
            include_sampled=include_sampled,
            request_id=core.new_request_id(),
        )

        async def unary(index: int) -> ResponseAssembler:
            info = await self._fetch_info(index)
            asm = ResponseAssembler(request)
            asm.add(await self._stub(index).Score(request, timeout=timeout, metadata=core.metadata))
            core.record(info, self._info_msgs[index], asm)
            return asm

        info = await self._call(self._fetch_info, core.next_target())
        if core.needs_stream(request, info):
            gen = self._run_stream(_as_async([request]), depth=0, device=device, timeout_s=timeout)
            try:
                return await anext(gen)
            finally:
                await gen.aclose()
        asm = await self._call(unary, core.current)
        return asm.payload(device)

    def stream(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int,
        *,
        depth: int = 4,
        dtype: str = "float16",
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> AsyncIterator[TeacherPayload]:
        """Payloads of ``batches`` in input order, ``depth`` requests in flight (see
        :meth:`TeacherClient.stream`); ``batches`` may be an async iterable."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
        core = self._core

        async def requests() -> AsyncIterator[pb.ScoreRequest | TeacherError]:
            async for b in _as_async(batches):
                yield request_from_batch(core, b, top_k, dtype, include_sampled)

        return self._run_stream(
            requests(), depth=depth, device=device, timeout_s=core.call_timeout(timeout_s)
        )

    async def _open_stream(self, index: int) -> _AsyncStream:
        await self._fetch_info(index)
        return _AsyncStream(self._stub(index), self._core.metadata)

    async def _run_stream(
        self,
        requests: AsyncIterator[Any],
        *,
        depth: int,
        device: torch.device | str,
        timeout_s: float,
    ) -> AsyncGenerator[TeacherPayload, None]:
        core = self._core
        window = _StreamWindow()
        index = core.next_target()
        conn: _AsyncStream | None = None
        exhausted = False
        failures = 0
        last: TeacherError | None = None

        async def fill(limit: int) -> None:
            nonlocal exhausted
            while not exhausted and len(window) < limit:
                request = await anext(requests, None)
                if request is None:
                    exhausted = True
                    return
                if isinstance(request, TeacherError):
                    window.add_failed(request)
                    continue
                window.add(request)
                assert conn is not None
                await conn.send(request)

        try:
            while True:
                if conn is None:
                    if failures:
                        if failures >= core.tries:
                            assert last is not None
                            raise core.unavailable(failures, last)
                        await asyncio.sleep(core.backoff(failures - 1))
                        index = core.fail_over(index)
                    core.current = index
                    try:
                        conn = await self._open_stream(index)
                    except grpc.RpcError as e:
                        last = error_from_rpc(e)
                        if not _is_retryable(last):
                            raise last from None
                        failures += 1
                        continue
                    for pending in window.unanswered():
                        await conn.send(pending.request)
                await fill(max(depth, 1))
                if not window:
                    return
                head = window.head()
                if head.assembler.complete:
                    window.pop()
                    if head.assembler.error is not None:
                        raise head.assembler.error
                    await fill(depth)
                    core.record(core.infos[index], self._info_msgs[index], head.assembler)
                    yield head.assembler.payload(device)
                    continue
                wait = head.sent_at + timeout_s - time.monotonic()
                try:
                    item = await conn.get(wait)
                except TimeoutError:
                    raise DeadlineExceededError(
                        f"request {head.request.request_id}: no complete answer within "
                        f"timeout_s {timeout_s} s",
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ) from None
                if item is _END or isinstance(item, grpc.RpcError):
                    last = (
                        error_from_rpc(item)
                        if isinstance(item, grpc.RpcError)
                        else TeacherUnavailableError("the teacher closed the stream early")
                    )
                    if not _is_retryable(last):
                        raise last from None
                else:
                    try:
                        if window.route(item):
                            failures = 0
                        continue
                    except _RetryStream as e:
                        last = e.error
                failures += 1
                await conn.close()
                conn = None
        finally:
            if conn is not None:
                await conn.close()

    async def close(self) -> None:
        """Close the channels and finish the recording."""
        if self._closed:
            return
        self._closed = True
        self._core.close_recorder()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
