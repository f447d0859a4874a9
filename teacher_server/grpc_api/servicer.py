"""The ``topk_distill.v1.Teacher`` gRPC servicer: each RPC through the request pipeline.

``Score`` and every request of a ``ScoreStream`` run through
:meth:`~teacher_server.pipeline.RequestPipeline.run` (validation, admission, backend,
metrics); this module only maps its :class:`~teacher_server.pipeline.Outcome` to gRPC
(its transport-free status to ``grpc.StatusCode``: :func:`topk_protocol.status.grpc_code`):
``context.abort`` with the status code (unary; the error's reason in the trailing
metadata), or an ``Error`` in the response for that request (stream, which goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

import grpc

from teacher_server.backends.base import Backend
from teacher_server.fair_share import client_identity
from teacher_server.grpc_api.answers import Outgoing, encode_response, encode_stream
from teacher_server.grpc_api.backpressure import (
    DEFAULT_STREAM_MAX_UNSENT_MB,
    DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
    StreamBudget,
)
from teacher_server.pipeline import Answered, Refused, RequestPipeline
from teacher_server.student_tokenizers import StudentTokenizers
from teacher_server.validation import Limits, ParsedRequest, Undecodable
from topk_protocol import (
    DTYPE_NAMES,
    ENCODING_NAMES,
    SCHEMA_VERSION,
    SequenceArrays,
    fits_one_message,
    pb,
    pb_grpc,
)
from topk_protocol.errors import ResourceExhaustedError
from topk_protocol.status import REASON_KEY, grpc_code

__all__ = ["TeacherServicer", "teacher_info_message"]


def teacher_info_message(
    backend: Backend, limits: Limits, students: StudentTokenizers | None = None
) -> pb.TeacherInfo:
    """The ``GetInfo`` answer for a loaded backend (and the student tokenizers it serves)."""
    info = backend.info
    return pb.TeacherInfo(
        student_tokenizers=[] if students is None else students.info(),
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_top_k=limits.max_top_k,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        schema_version=SCHEMA_VERSION,
        supported_dtypes=list(DTYPE_NAMES.values()),  # type: ignore[arg-type]
        supported_encodings=[ENCODING_NAMES[e] for e in backend.supported_encodings],  # type: ignore[misc]
        backend=info.name,
        max_tokens_per_request=limits.max_tokens_per_request,
        max_message_bytes=limits.max_message_bytes,
        max_sequence_length=limits.max_sequence_length,
        max_samples=limits.max_samples,
        engine_dtype=info.dtype,
        teacher_temperature=info.temperature,
        max_candidates=limits.max_candidates,
        answer_fingerprint=None
        if info.answer_fingerprint is None
        else info.answer_fingerprint.to_message(),
    )


class TeacherServicer(pb_grpc.TeacherServicer):
    """Serves ``GetInfo``, ``Score`` and ``ScoreStream`` through ``pipeline``; each
    ``ScoreStream`` holds at most ``stream_budget`` (requests, bytes) unsent
    (:mod:`teacher_server.grpc_api.backpressure`)."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        stream_budget: tuple[int, int] = (
            DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
            DEFAULT_STREAM_MAX_UNSENT_MB * 1024 * 1024,
        ),
    ) -> None:
        self._pipeline = pipeline
        StreamBudget(*stream_budget)  # refuses bad values now, not at the first stream
        self._stream_budget = stream_budget
        # Every stream's budget while its state is alive: the gauge counts what the
        # server still holds for streams, so a stream whose client went must drop to 0.
        self._streams: weakref.WeakSet[StreamBudget] = weakref.WeakSet()
        pipeline.metrics.streams_open.set_function(lambda: len(self._streams))

    # -- RPCs --------------------------------------------------------------------------
    async def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TeacherInfo:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        refusal = self._pipeline.lifecycle.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        pipeline = self._pipeline
        return teacher_info_message(pipeline.backend, pipeline.limits, pipeline.students)

    async def Score(
        self, request: pb.ScoreRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> bytes:
        limit = self._pipeline.limits.max_message_bytes

        async def fits_one_message_or_refuse(parsed: ParsedRequest) -> None:
            size = parsed.response_bytes()
            if not fits_one_message(size, len(parsed.sequences), limit):
                raise ResourceExhaustedError(
                    f"response: {size} payload bytes (+ framing) would exceed max_message_bytes "
                    f"{limit}; use ScoreStream or fewer positions"
                )

        outcome = await self._pipeline.run(
            "Score",
            request,
            encode_response,
            before_admission=fits_one_message_or_refuse,
            turn=(_client(context), None),
        )
        if isinstance(outcome, Answered):
            return outcome.answer
        trailers = ((REASON_KEY, outcome.reason),) if outcome.reason else ()
        await context.abort(grpc_code(outcome.code), outcome.message, trailing_metadata=trailers)
        raise AssertionError("unreachable: context.abort raises")

    async def _stream_one(
        self,
        request: pb.ScoreRequest,
        out: asyncio.Queue[_Outgoing],
        budget: StreamBudget,
        client: str,
    ) -> None:
        """Answer one request of a stream: its chunks, or one ``Error`` message. Its
        answer's bytes are reserved in ``budget`` before it is admitted; the stream gives
        them back once the final message is sent."""
        held = 0

        async def reserve(parsed: ParsedRequest) -> None:
            nonlocal held
            held = parsed.response_bytes()
            await budget.take_bytes(held)

        limits = self._pipeline.limits
        chunk_bytes = min(limits.chunk_bytes, limits.max_message_bytes // 2)

        def finish(
            parsed: ParsedRequest, scored: list[SequenceArrays], seconds: float
        ) -> list[Outgoing]:
            return encode_stream(parsed, scored, seconds, chunk_bytes=chunk_bytes)

        outcome = await self._pipeline.run(
            "ScoreStream", request, finish, before_admission=reserve, turn=(client, budget)
        )
        if isinstance(outcome, Refused):
            error = pb.Error(
                code=grpc_code(outcome.code).value[0],
                message=outcome.message,
                reason=outcome.reason,
            )
            answer = pb.ScoreResponse(request_id=request.request_id, final=True, error=error)
            await out.put((Outgoing(answer.SerializeToString(), True), held))
            return
        for msg in outcome.answer:
            await out.put((msg, held))

    async def ScoreStream(
        self,
        request_iterator: AsyncIterator[pb.ScoreRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        # Unbounded as a queue, bounded by the budget: every item was reserved in it.
        out: asyncio.Queue[_Outgoing] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        unsent = self._pipeline.metrics.stream_unsent_bytes
        # Also names the stream's turn in admission.
        budget = StreamBudget(*self._stream_budget, on_bytes=unsent.inc)
        self._streams.add(budget)
        client = _client(context)
        requests = aiter(request_iterator)

        async def read() -> None:
            try:
                while True:
                    # Backpressure: read the next request only when this stream may hold
                    # one more (teacher_server.grpc_api.backpressure).
                    await budget.take_request()
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        break
                    if isinstance(request, Undecodable):
                        # No request_id to answer it by: the stream itself is broken.
                        await out.put(request)
                        return
                    task = asyncio.create_task(self._stream_one(request, out, budget, client))
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
            # Answers reserved and never handed to gRPC go with this frame.
            unsent.dec(budget.bytes)
            if budget.requests:
                self._pipeline.memory_released()


def _client(context: grpc.aio.ServicerContext) -> str:
    """The caller's identity for admission turns (:func:`client_identity`)."""
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            authorization = value if isinstance(value, str) else value.decode(errors="replace")
    return client_identity(authorization, context.peer())


#: An answer message and the bytes its request holds in the stream's budget; an
#: undecodable request (the stream is closed); None: the stream's requests are all answered.
_Outgoing = tuple[Outgoing, int] | Undecodable | None
