"""One request, whatever its front end: validate, admit, score, answer, release, count.

gRPC ``Score`` and ``ScoreStream`` (:mod:`teacher_server.grpc_api.servicer`) and the HTTP routes
of TRL's teacher client (:mod:`teacher_server.http_api.trl`) hand each request to
:meth:`RequestPipeline.run` with a function that builds their answer from the scored
arrays; it returns an :class:`Outcome`, which the front end only maps to its transport
(a gRPC status, an ``Error`` message of the stream, an HTTP status). Every failure is
mapped here, once: a typed error of :mod:`topk_protocol.errors` to its transport-free
:class:`~topk_protocol.codes.Status` (:func:`topk_protocol.codes.code_of`), anything
else to INTERNAL (logged); a cancelled request is counted and the cancellation goes on.
This module imports no transport (no grpc, no front end: an import contract in
``pyproject.toml``).

The event loop stays free for the probes (``/healthz``, ``/readyz``, gRPC health), which
share it: validating a request of 10,000 sequences, or building its answer, is a Python
loop of tens to hundreds of milliseconds. So requests above :data:`THREAD_SEQUENCES`
sequences or :data:`THREAD_TOKEN_BYTES` bytes of token ids are validated, and answered,
in a worker thread (``asyncio.to_thread``): the loop keeps running between the thread's
GIL slices (Python hands the GIL over every 5 ms) and while numpy works without it.
Small requests stay on the loop, where a thread hop (~0.1 ms) would cost more than the
work. :func:`gather_bounded` keeps at most :data:`MAX_SEQUENCES_IN_FLIGHT` sequences of
one request in the engine at once, so that the objects alive (and the garbage
collector's passes over them) stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from teacher_server.admission import AdmissionQueue, AdmissionRefused
from teacher_server.backends.base import Backend
from teacher_server.leak_injection import injected_leak_mib, leak_per_request
from teacher_server.lifecycle import Lifecycle
from teacher_server.metrics import TeacherMetrics
from teacher_server.student_tokenizers import StudentTokenizers
from teacher_server.validation import (
    Limits,
    ParsedRequest,
    ParsedSequence,
    Undecodable,
    parse_request,
)
from topk_protocol import SequenceArrays, pb
from topk_protocol.checks import check_encoding
from topk_protocol.codes import Status, code_of
from topk_protocol.errors import InvalidRequestError, TeacherError, TeacherUnavailableError

__all__ = [
    "MAX_SEQUENCES_IN_FLIGHT",
    "THREAD_SEQUENCES",
    "THREAD_TOKEN_BYTES",
    "Answered",
    "Finish",
    "Incoming",
    "Outcome",
    "Refused",
    "RequestPipeline",
    "gather_bounded",
]

log = logging.getLogger(__name__)

#: Requests with more sequences than this are validated and answered in a thread.
THREAD_SEQUENCES = 64
#: ... and so are requests with more bytes of token ids than this (64 Ki tokens).
THREAD_TOKEN_BYTES = 256 * 1024
#: :func:`gather_bounded` runs at most this many sequences of one request at once.
MAX_SEQUENCES_IN_FLIGHT = 512

T = TypeVar("T")
R = TypeVar("R")

#: What a front end hands the pipeline: a decoded ``ScoreRequest``, bytes that did not
#: decode (:class:`~teacher_server.validation.Undecodable`), or a function that reads
#: another front end's body into a ``ScoreRequest`` (run in a worker thread once the
#: teacher is ready; it raises typed errors).
Incoming: TypeAlias = pb.ScoreRequest | Undecodable | Callable[[], pb.ScoreRequest]

#: A front end's answer from ``(request, scored sequences, teacher seconds so far)``;
#: runs while the request holds its slot (a drain waits for it), in a worker thread when
#: the request is large.
Finish: TypeAlias = Callable[[ParsedRequest, list[SequenceArrays], float], T]


@dataclass(frozen=True)
class Answered(Generic[T]):
    """A request answered: the front end's answer."""

    answer: T
    code: Status = Status.OK


@dataclass(frozen=True)
class Refused:
    """A request that failed: the status ``code``, the ``message`` naming the field and
    the limit, and the error's ``reason`` (empty for most kinds: ``topk_protocol.codes``).
    Each front end maps ``code`` to its transport."""

    code: Status
    message: str
    reason: str = ""

    @classmethod
    def of(cls, error: TeacherError) -> Refused:
        """The outcome of a typed error (its status: :func:`~topk_protocol.codes.code_of`)."""
        code, reason = code_of(error)
        return cls(code, error.message, reason)


#: How one request ended.
Outcome: TypeAlias = Answered[T] | Refused


def _is_large(num_sequences: int, token_bytes: int) -> bool:
    return num_sequences > THREAD_SEQUENCES or token_bytes > THREAD_TOKEN_BYTES


async def _in_thread_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    if large:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class RequestPipeline:
    """Runs requests against ``backend`` while ``lifecycle`` is READY (before: still
    loading; after: draining; UNAVAILABLE otherwise, which clients retry), each holding
    a slot of ``admission`` while it is scored and answered, every one counted in
    ``metrics`` under its front end's ``method``. :meth:`set_limits` installs the final
    limits once the backend is loaded (the vocabulary size is known then). A request
    naming a student tokenizer is checked against that tokenizer's vocabulary and scored
    through ``students`` (:mod:`teacher_server.student_tokenizers`)."""

    def __init__(
        self,
        backend: Backend,
        limits: Limits,
        metrics: TeacherMetrics,
        lifecycle: Lifecycle,
        admission: AdmissionQueue,
        *,
        students: StudentTokenizers | None = None,
    ) -> None:
        self._backend = backend
        self._students = students or StudentTokenizers()
        self._limits = limits
        self._metrics = metrics
        self._lifecycle = lifecycle
        self._admission = admission
        metrics.watch_compute(backend.compute)
        injected_leak_mib()  # a bad TOPK_DISTILL_INJECT_LEAK_MIB fails now, not mid-request

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def students(self) -> StudentTokenizers:
        return self._students

    @property
    def lifecycle(self) -> Lifecycle:
        return self._lifecycle

    @property
    def metrics(self) -> TeacherMetrics:
        return self._metrics

    def memory_released(self) -> None:
        """A client went leaving answers unsent: what was held for it is freed, so a new
        quiet spell starts (the memory trim runs again once it has lasted,
        :mod:`teacher_server.malloc_trim`)."""
        self._admission.restart_quiet_spell()

    @property
    def limits(self) -> Limits:
        return self._limits

    def set_limits(self, limits: Limits) -> None:
        """Backend loaded: the final limits (vocab size now known)."""
        self._limits = limits

    async def run(
        self,
        method: str,
        request: Incoming,
        finish: Finish[T],
        *,
        before_admission: Callable[[ParsedRequest], Awaitable[None]] | None = None,
        finish_in_thread: bool = False,
        turn: tuple[Hashable, Hashable] = (None, None),
    ) -> Outcome[T]:
        """Run one request to its :class:`Outcome`: validate ``request``, await
        ``before_admission(parsed)`` (a front end's own refusal or reservation), wait for
        a slot (in turn by ``turn``, its ``(client, stream)``:
        :mod:`teacher_server.fair_share`; default: an anonymous stream of its own),
        score every sequence, ``finish`` (in a thread when the request is large,
        or always with ``finish_in_thread``), release the slot, count. Raises only
        ``CancelledError`` (counted as CANCELLED)."""
        t0 = time.perf_counter()
        outcome: Outcome[T]
        try:
            parsed = await self._validate(request)
            if before_admission is not None:
                await before_admission(parsed)
            answer = await self._admitted(parsed, finish, finish_in_thread, t0, turn)
        except TeacherError as e:
            outcome = Refused.of(e)
        except asyncio.CancelledError:
            self._count(method, Status.CANCELLED, t0)
            raise
        except Exception as e:
            log.exception("%s failed", method)
            outcome = Refused.of(TeacherError(f"teacher: scoring failed: {e}"))
        else:
            self._metrics.positions.inc(parsed.num_positions)
            self._metrics.payload_bytes.inc(parsed.response_bytes())
            outcome = Answered(answer)
        self._count(method, outcome.code, t0)
        return outcome

    async def _validate(self, request: Incoming) -> ParsedRequest:
        """The validated request (a large one in a worker thread)."""
        if isinstance(request, Undecodable):
            raise InvalidRequestError(request.message)
        refusal = self._lifecycle.refusal()
        if refusal is not None:
            raise TeacherUnavailableError(refusal)
        if not isinstance(request, pb.ScoreRequest):
            request = await asyncio.to_thread(request)
        n = len(request.sequences)
        # Summing the token bytes is itself a loop over the sequences: only for few of them.
        token_bytes = (
            0 if n > THREAD_SEQUENCES else sum(len(s.token_ids) for s in request.sequences)
        )
        limits = self._limits
        if request.student_tokenizer:  # its ids are the student's
            limits = self._students.limits(request.student_tokenizer, limits)
        return await _in_thread_if(_is_large(n, token_bytes), parse_request, request, limits)

    async def _admitted(
        self,
        parsed: ParsedRequest,
        finish: Finish[T],
        in_thread: bool,
        t0: float,
        turn: tuple[Hashable, Hashable],
    ) -> T:
        """Wait for a slot, score, finish, release the slot."""
        try:
            await self._admission.acquire(*turn)
        except AdmissionRefused as e:
            raise TeacherUnavailableError(e.message) from None
        leak_per_request()  # nothing unless a test injects a leak (leak_injection)
        try:
            scored = await self._score(parsed)
            large = in_thread or _is_large(len(parsed.sequences), 4 * parsed.num_positions)
            return await _in_thread_if(large, finish, parsed, scored, time.perf_counter() - t0)
        finally:
            self._admission.release()

    async def _score(self, parsed: ParsedRequest) -> list[SequenceArrays]:
        """Score every sequence concurrently (the engine batches them)."""
        self._backend.check_request(parsed)
        check_encoding(parsed.options.encoding, self._backend.supported_encodings)
        options = parsed.options
        k = options.top_k
        index = {id(seq): i for i, seq in enumerate(parsed.sequences)}

        async def one(seq: ParsedSequence) -> SequenceArrays:
            wanted = None if seq.candidate_ids is None else seq.num_candidates
            if seq.start == seq.end:  # nothing asked: no engine call
                return SequenceArrays.empty(k, seq.start, wanted)
            if options.student_tokenizer is not None:
                scored = await self._students.score(
                    seq,
                    options,
                    self._backend.score,
                    field=f"sequences[{index[id(seq)]}].token_ids",
                    max_sequence_length=self._limits.max_sequence_length,
                )
                self._metrics.count_student_rows(scored.row_kinds)
                return scored
            scored = await self._backend.score(seq, options)
            if wanted is not None and scored.num_candidates != wanted:
                raise RuntimeError(
                    f"the backend answered {scored.num_candidates} candidate columns "
                    f"for the {wanted} asked"
                )
            return scored

        return await gather_bounded(one, parsed.sequences)

    def _count(self, method: str, code: Status, t0: float) -> None:
        self._metrics.requests.labels(method, code.value).inc()
        self._metrics.latency.labels(method).observe(time.perf_counter() - t0)


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
