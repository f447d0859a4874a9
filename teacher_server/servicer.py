"""The ``topk_distill.v1.Teacher`` gRPC servicer: validation, admission, scoring, packing.

State lives in private fields. Validation, admission and the backends raise the
protocol's typed errors (:mod:`topk_protocol.errors`); this module alone turns them into
gRPC statuses (:func:`topk_protocol.status.status_of`): ``context.abort`` with the code
(unary; the error's reason in the trailing metadata) or an ``Error`` in the response for
that request (stream, which goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
import numpy as np

from teacher_server.admission import AdmissionQueue, AdmissionRefused
from teacher_server.backends.base import Backend, ScoredSequence
from teacher_server.backpressure import (
    DEFAULT_STREAM_MAX_UNSENT_MB,
    DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
    StreamBudget,
)
from teacher_server.leak_injection import injected_leak_mib, leak_per_request
from teacher_server.lifecycle import Lifecycle
from teacher_server.metrics import TeacherMetrics
from teacher_server.offload import (
    Outgoing,
    encode_response_off_loop,
    gather_bounded,
    parse_off_loop,
    stream_responses_off_loop,
)
from teacher_server.rpc_handlers import Undecodable
from teacher_server.validation import Limits, ParsedRequest, ParsedSequence
from topk_protocol import DTYPE_NAMES, SCHEMA_VERSION, fits_one_message, pb, pb_grpc
from topk_protocol.errors import (
    InvalidRequestError,
    ResourceExhaustedError,
    TeacherError,
    TeacherUnavailableError,
)
from topk_protocol.status import REASON_KEY, status_of

__all__ = ["TeacherServicer", "teacher_info_message"]

log = logging.getLogger(__name__)

R = TypeVar("R")


def teacher_info_message(backend: Backend, limits: Limits) -> pb.TeacherInfo:
    """The ``GetInfo`` answer for a loaded backend."""
    info = backend.info
    return pb.TeacherInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_top_k=limits.max_top_k,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        schema_version=SCHEMA_VERSION,
        supported_dtypes=list(DTYPE_NAMES.values()),  # type: ignore[arg-type]
        backend=info.name,
        max_tokens_per_request=limits.max_tokens_per_request,
        max_message_bytes=limits.max_message_bytes,
        max_sequence_length=limits.max_sequence_length,
        engine_dtype=info.dtype,
        teacher_temperature=info.temperature,
    )


class TeacherServicer(pb_grpc.TeacherServicer):
    """Serves ``GetInfo``, ``Score`` and ``ScoreStream`` from a :class:`Backend`.

    Requests are served only while ``lifecycle`` is READY (before: still loading; after:
    draining), each holding a slot of ``admission`` while it works; otherwise they fail
    with UNAVAILABLE, which clients retry. :meth:`set_limits` installs the final limits
    once the backend is loaded (the vocabulary size is known then).
    """

    def __init__(
        self,
        backend: Backend,
        limits: Limits,
        metrics: TeacherMetrics,
        lifecycle: Lifecycle,
        admission: AdmissionQueue,
        stream_budget: tuple[int, int] = (
            DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
            DEFAULT_STREAM_MAX_UNSENT_MB * 1024 * 1024,
        ),
    ) -> None:
        self._backend = backend
        self._limits = limits
        self._metrics = metrics
        self._lifecycle = lifecycle
        self._admission = admission
        # (requests, bytes) one ScoreStream may hold unsent (teacher_server.backpressure)
        StreamBudget(*stream_budget)  # refuses bad values now, not at the first stream
        self._stream_budget = stream_budget
        injected_leak_mib()  # a bad TOPK_DISTILL_INJECT_LEAK_MIB fails now, not mid-request

    def set_limits(self, limits: Limits) -> None:
        """Backend loaded: the final limits (vocab size now known)."""
        self._limits = limits

    @property
    def limits(self) -> Limits:
        return self._limits

    async def score_rendered(
        self,
        method: str,
        prepare: Callable[[], tuple[pb.ScoreRequest, Callable[[list[ScoredSequence]], R]]],
    ) -> R:
        """One request from another front end (the HTTP routes; ``method`` names it in the
        metrics) with the same lifecycle check, validation, admission, backend and metrics
        as ``Score``. ``prepare()`` (in a worker thread, after the lifecycle check) parses
        the front end's request into a ``ScoreRequest`` and a renderer; ``render(scored)``
        runs in a worker thread while the slot is held (a drain waits for it). Raises the
        typed error of a refusal (a plain ``TeacherError`` on a failure: INTERNAL)."""
        t0 = time.perf_counter()
        try:
            refusal = self._lifecycle.refusal()
            if refusal is not None:
                raise TeacherUnavailableError(refusal)
            request, render = await asyncio.to_thread(prepare)
            parsed = await self._admit(request)
        except TeacherError as e:
            self._count(method, status_of(e)[0], t0)
            raise
        try:
            scored = await self._score(parsed)
            out = await asyncio.to_thread(render, scored)
        except TeacherError as e:
            self._count(method, status_of(e)[0], t0)
            raise
        except asyncio.CancelledError:
            self._count(method, grpc.StatusCode.CANCELLED, t0)
            raise
        except Exception as e:
            log.exception("%s failed", method)
            self._count(method, grpc.StatusCode.INTERNAL, t0)
            raise TeacherError(f"teacher: scoring failed: {e}") from None
        finally:
            self._release()
        self._count_payload(parsed)
        self._count(method, grpc.StatusCode.OK, t0)
        return out

    # -- admission ---------------------------------------------------------------------
    async def _validate(self, request: pb.ScoreRequest | Undecodable) -> ParsedRequest:
        """The validated request (large ones off the event loop: ``offload``)."""
        if isinstance(request, Undecodable):
            raise InvalidRequestError(request.message)
        refusal = self._lifecycle.refusal()
        if refusal is not None:
            raise TeacherUnavailableError(refusal)
        return await parse_off_loop(request, self._limits)

    async def _acquire(self) -> None:
        """Wait for a slot; the caller must :meth:`_release` it."""
        try:
            await self._admission.acquire()
        except AdmissionRefused as e:
            raise TeacherUnavailableError(e.message) from None
        leak_per_request()  # nothing unless a test injects a leak (leak_injection)

    async def _admit(self, request: pb.ScoreRequest | Undecodable) -> ParsedRequest:
        """Validate, then wait for a slot; the caller must :meth:`_release` it."""
        parsed = await self._validate(request)
        await self._acquire()
        return parsed

    def _release(self) -> None:
        self._admission.release()

    async def _score(self, parsed: ParsedRequest) -> list[ScoredSequence]:
        """Score every sequence concurrently (the engine batches them)."""
        self._backend.check_request(parsed)
        options = parsed.options
        k = options.top_k

        async def one(seq: ParsedSequence) -> ScoredSequence:
            if seq.start == seq.end:  # nothing asked: no engine call
                return ScoredSequence(
                    np.zeros((0, k), np.int32),
                    np.zeros((0, k), np.float32),
                    np.zeros(0, np.float32),
                    seq.start,
                )
            return await self._backend.score(seq, options)

        return await gather_bounded(one, parsed.sequences)

    def _count(self, method: str, code: grpc.StatusCode, t0: float) -> None:
        self._metrics.requests.labels(method, code.name).inc()
        self._metrics.latency.labels(method).observe(time.perf_counter() - t0)

    async def _abort(
        self, method: str, error: TeacherError, t0: float, context: grpc.aio.ServicerContext
    ) -> None:
        """End a unary call with ``error``'s status (its reason in the trailers): raises
        (``context.abort`` does)."""
        code, reason = status_of(error)
        self._count(method, code, t0)
        trailers = ((REASON_KEY, reason),) if reason else ()
        await context.abort(code, error.message, trailing_metadata=trailers)

    def _error_response(
        self, method: str, request_id: str, error: TeacherError, t0: float
    ) -> Outgoing:
        """The stream's final answer to one failed request (the stream goes on)."""
        code, reason = status_of(error)
        self._count(method, code, t0)
        message = pb.ScoreResponse(
            request_id=request_id,
            final=True,
            error=pb.Error(code=code.value[0], message=error.message, reason=reason),
        )
        return Outgoing(message, True)

    def _count_payload(self, parsed: ParsedRequest) -> None:
        self._metrics.positions.inc(parsed.num_positions)
        self._metrics.payload_bytes.inc(parsed.response_bytes())

    # -- RPCs --------------------------------------------------------------------------
    async def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TeacherInfo:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        refusal = self._lifecycle.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        return teacher_info_message(self._backend, self._limits)

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse | bytes:
        t0 = time.perf_counter()
        try:
            parsed = await self._admit(request)
        except TeacherError as e:
            await self._abort("Score", e, t0, context)
        try:
            size = parsed.response_bytes()
            if not fits_one_message(size, len(parsed.sequences), self._limits.max_message_bytes):
                raise ResourceExhaustedError(
                    f"response: {size} payload bytes (+ framing) would exceed max_message_bytes "
                    f"{self._limits.max_message_bytes}; use ScoreStream or fewer positions"
                )
            scored = await self._score(parsed)
            resp = await encode_response_off_loop(parsed, scored, time.perf_counter() - t0)
        except TeacherError as e:
            await self._abort("Score", e, t0, context)
        except asyncio.CancelledError:
            self._count("Score", grpc.StatusCode.CANCELLED, t0)
            raise
        except Exception as e:
            log.exception("Score failed")
            self._count("Score", grpc.StatusCode.INTERNAL, t0)
            await context.abort(grpc.StatusCode.INTERNAL, f"teacher: scoring failed: {e}")
        finally:
            self._release()
        self._count_payload(parsed)
        self._count("Score", grpc.StatusCode.OK, t0)
        return resp

    async def _stream_one(
        self, request: pb.ScoreRequest, out: asyncio.Queue[_Outgoing], budget: StreamBudget
    ) -> None:
        """Answer one request of a stream: its chunks, or one ``Error`` message. Its
        answer's bytes are reserved in ``budget`` before it is scored; the stream gives
        them back once the final message is sent."""
        t0 = time.perf_counter()
        held = 0
        try:
            parsed = await self._validate(request)
            held = parsed.response_bytes()
            await budget.take_bytes(held)
            await self._acquire()
        except TeacherError as e:
            await out.put((self._error_response("ScoreStream", request.request_id, e, t0), held))
            return
        try:
            scored = await self._score(parsed)
            responses: list[Outgoing] = await stream_responses_off_loop(
                parsed.request_id,
                scored,
                parsed.options,
                chunk_bytes=min(self._limits.chunk_bytes, self._limits.max_message_bytes // 2),
                teacher_seconds=time.perf_counter() - t0,
            )
            del scored
            for msg in responses:
                await out.put((msg, held))
        except TeacherError as e:  # refused by the backend (e.g. replay: not recorded)
            await out.put((self._error_response("ScoreStream", parsed.request_id, e, t0), held))
            return
        except asyncio.CancelledError:
            self._count("ScoreStream", grpc.StatusCode.CANCELLED, t0)
            raise
        except Exception as e:
            log.exception("ScoreStream request failed")
            failed = TeacherError(f"teacher: scoring failed: {e}")
            await out.put(
                (self._error_response("ScoreStream", parsed.request_id, failed, t0), held)
            )
            return
        finally:
            self._release()
        self._count_payload(parsed)
        self._count("ScoreStream", grpc.StatusCode.OK, t0)

    async def ScoreStream(
        self,
        request_iterator: AsyncIterator[pb.ScoreRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ScoreResponse | bytes]:
        # Unbounded as a queue, bounded by the budget: every item was reserved in it.
        out: asyncio.Queue[_Outgoing] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        budget = StreamBudget(*self._stream_budget)
        requests = aiter(request_iterator)

        async def read() -> None:
            try:
                while True:
                    # Backpressure: read the next request only when this stream may hold
                    # one more (teacher_server.backpressure).
                    await budget.take_request()
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        break
                    if isinstance(request, Undecodable):
                        # No request_id to answer it by: the stream itself is broken.
                        await out.put(request)
                        return
                    task = asyncio.create_task(self._stream_one(request, out, budget))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*list(tasks))
            finally:
                await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                if isinstance(item, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
                    return  # abort raised; never reached
                msg, held = item
                del item
                yield msg.message  # returns once gRPC has taken it (flow control permitting)
                if msg.final:
                    await budget.give_back(held)
                del msg
            await reader
        finally:
            # Client gone, cancelled or deadline expired: stop the engine work too.
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


#: An answer message and the bytes its request holds in the stream's budget; an
#: undecodable request (the stream is closed); None: the stream's requests are all answered.
_Outgoing = tuple[Outgoing, int] | Undecodable | None
