"""Keep the event loop free for probes: the CPU work of large requests runs in a thread.

The gRPC servicer, the HTTP probes (``/healthz``, ``/readyz``) and the gRPC health
service share one asyncio loop. Validating a request of 10,000 sequences, or packing its
answer into messages, is a Python loop of tens to hundreds of milliseconds; on the loop
it would hold every probe for that long, and a few such requests at once add up past a
probe's 1 s budget. So requests above :data:`OFFLOAD_SEQUENCES` sequences or
:data:`OFFLOAD_TOKEN_BYTES` bytes of token ids are validated, and their answers encoded,
in a worker thread (``asyncio.to_thread``): the loop keeps running between the thread's
GIL slices (Python hands the GIL over every 5 ms) and while numpy works without it.
Small requests stay on the loop, where a thread hop (~0.1 ms) would cost more than the
work. Large answers are also serialized there (gRPC would serialize them on the loop):
:class:`Outgoing` carries the bytes. :func:`gather_bounded` keeps at most 512 sequences
of one request in the engine at once, so that the objects alive (and the garbage
collector's passes over them) stay bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from teacher_server.payloads import encode_scored, iter_stream_responses
from teacher_server.validation import Limits, ParsedRequest, parse_request
from topk_protocol import RequestOptions, SequenceArrays, pb

__all__ = [
    "MAX_SEQUENCES_IN_FLIGHT",
    "OFFLOAD_SEQUENCES",
    "OFFLOAD_TOKEN_BYTES",
    "Outgoing",
    "encode_response_off_loop",
    "gather_bounded",
    "parse_off_loop",
    "stream_responses_off_loop",
]

#: Requests with more sequences than this are validated and encoded in a thread.
OFFLOAD_SEQUENCES = 64
#: ... and so are requests with more bytes of token ids than this (64 Ki tokens).
OFFLOAD_TOKEN_BYTES = 256 * 1024
#: :func:`gather_bounded` runs at most this many sequences of one request at once.
MAX_SEQUENCES_IN_FLIGHT = 512

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Outgoing:
    """One answer message ready to send: ``message`` is the ``ScoreResponse`` or, for a
    large one, its serialized bytes (the handlers' serializer passes bytes through);
    ``final`` says whether it is its request's last."""

    message: pb.ScoreResponse | bytes
    final: bool


def _is_large(num_sequences: int, token_bytes: int) -> bool:
    return num_sequences > OFFLOAD_SEQUENCES or token_bytes > OFFLOAD_TOKEN_BYTES


async def _maybe_in_thread(large: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    if large:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def parse_off_loop(request: pb.ScoreRequest, limits: Limits) -> ParsedRequest:
    """:func:`~teacher_server.validation.parse_request`, in a thread for large requests."""
    n = len(request.sequences)
    # Summing the token bytes is itself a loop over the sequences: only for few of them.
    token_bytes = 0 if n > OFFLOAD_SEQUENCES else sum(len(s.token_ids) for s in request.sequences)
    return await _maybe_in_thread(_is_large(n, token_bytes), parse_request, request, limits)


def _is_large_answer(parsed: ParsedRequest) -> bool:
    return _is_large(len(parsed.sequences), 4 * parsed.num_positions)


def _encode_response(
    parsed: ParsedRequest, scored: Sequence[SequenceArrays], teacher_seconds: float
) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        request_id=parsed.request_id,
        sequences=[
            encode_scored(s, parsed.options, sequence_index=i) for i, s in enumerate(scored)
        ],
        final=True,
        teacher_seconds=teacher_seconds,
    )


async def encode_response_off_loop(
    parsed: ParsedRequest, scored: Sequence[SequenceArrays], teacher_seconds: float
) -> pb.ScoreResponse | bytes:
    """The ``Score`` answer: every sequence in one message (built and serialized in a
    thread when large)."""
    if not _is_large_answer(parsed):
        return _encode_response(parsed, scored, teacher_seconds)

    def build() -> bytes:
        return _encode_response(parsed, scored, teacher_seconds).SerializeToString()

    return await asyncio.to_thread(build)


async def stream_responses_off_loop(
    request_id: str, scored: Sequence[SequenceArrays], options: RequestOptions, **kwargs: Any
) -> list[Outgoing]:
    """:func:`~teacher_server.payloads.iter_stream_responses` as a list (built and
    serialized in a thread when large)."""
    positions = sum(len(s.ids) for s in scored)
    large = _is_large(len(scored), 4 * positions)

    def build() -> list[Outgoing]:
        return [
            Outgoing(m.SerializeToString() if large else m, m.final)
            for m in iter_stream_responses(request_id, scored, options, **kwargs)
        ]

    return await _maybe_in_thread(large, build)


async def gather_bounded(fn: Callable[[R], Awaitable[T]], items: Sequence[R]) -> list[T]:
    """``asyncio.gather(*(fn(x) for x in items))`` with at most
    :data:`MAX_SEQUENCES_IN_FLIGHT` running at once (results in order; the first error
    cancels the rest and is raised).

    A request of 10,000 sequences would otherwise put 10,000 requests into the engine at
    once: no faster (the engine batches at most ``max_num_seqs`` per step), but every one
    of them alive at once, hundreds of objects each, and the garbage collector's full
    passes over them stopped the event loop for seconds (probes included).
    """
    if len(items) <= MAX_SEQUENCES_IN_FLIGHT:
        return list(await asyncio.gather(*(fn(x) for x in items)))
    results: list[Any] = [None] * len(items)
    indices = iter(range(len(items)))

    async def worker() -> None:
        for i in indices:  # shared: each index is taken by one worker
            results[i] = await fn(items[i])

    workers = [asyncio.ensure_future(worker()) for _ in range(MAX_SEQUENCES_IN_FLIGHT)]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        raise
    return results
