"""``AsyncTeacherClient``: fetch top-k payloads from a teacher over gRPC (asyncio).

This is the one client core; :class:`student_client.clients.blocking.TeacherClient` is a blocking
facade that runs it on a background event loop.

- ``score`` answers one batch (unary ``Score``, or ``ScoreStream`` when the answer would
  not fit in one message);
- ``stream`` keeps ``depth`` requests in flight on one ``ScoreStream`` and yields the
  payloads in input order, so the teacher works while the student computes;
- retries with backoff on UNAVAILABLE and on a connection lost mid-stream (unanswered
  requests are re-sent, to the next target when there are several; a batch is neither
  lost nor yielded twice); per-request deadline; typed exceptions
  (:mod:`topk_protocol.errors`);
- ``record_to=`` records every answered request (:mod:`topk_protocol.recording`).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Sequence,
)
from dataclasses import replace
from typing import Any

import grpc
import torch
from typing_extensions import Unpack

from student_client.clients.answer_recorder import AnswerRecorder
from student_client.clients.channels import channel_credentials, parse_targets, positive
from student_client.clients.client_options import ClientOptions, ClientSettings
from student_client.clients.stream_loop import StreamLoop
from student_client.clients.targets import Connecting, RetryPolicy, TargetSet
from student_client.clients.window import Answer, DecodedStream, Outgoing, as_async
from student_client.data.alignment import align, build_aligned_request
from student_client.data.assembler import ResponseAssembler
from student_client.data.batch import (
    AnswerKeywords,
    LiveScoreKeywords,
    ScoreBatch,
    split_call,
    split_stream,
)
from student_client.data.payload import TeacherPayload
from topk_protocol import (
    RequestOptions,
    TeacherInfo,
    fits_one_message,
    pb,
    response_bytes,
)
from topk_protocol._closeable import AsyncCloseable
from topk_protocol.checks import check_depth
from topk_protocol.errors import (
    ResourceExhaustedError,
    TeacherError,
)

__all__ = ["AsyncTeacherClient"]


class AsyncTeacherClient(AsyncCloseable, DecodedStream[Answer]):
    """asyncio client of a ``topk_distill.v1.Teacher`` service.

    Args:
        target: ``"host:port"``; ``"dns:///name:port"`` (gRPC resolves it and spreads
            calls round-robin over every address); or a list (or comma-separated string)
            of ``host:port``, used round-robin, moving to the next one on failure.
        token: shared bearer token, sent as ``authorization: Bearer <token>``.
        tls: None/False for plaintext, True for TLS with the system roots, or the root
            certificate (PEM bytes or a path).
        tls_server_name: name to verify in the server certificate instead of the host.
        timeout_s: deadline of each call; in a stream, of each request from the moment
            it is sent.
        max_message_mb: largest message this client sends or receives.
        retries: extra tries after an UNAVAILABLE error or a lost connection.
        backoff_s, max_backoff_s: first and largest wait between tries (doubling).
        expect_vocab_size, expect_tokenizer_fingerprint: checked against ``GetInfo``
            before the first request to a target (with ``student_tokenizer``: against that
            tokenizer's); a mismatch raises VocabMismatchError.
        expect_temperature: the teacher temperature the student's loss is set up for,
            checked against ``GetInfo`` the same way (None: any); a teacher serving
            another one raises TeacherMismatchError naming ``teacher_temperature``.
        record_to: record every answered sequence to this recording directory or URI
            (``s3://bucket/prefix``; :mod:`topk_protocol.recording`). The recording holds
            the options of the first request: K, dtype, encoding (packed and its bits)
            and the sampling options (``samples``, ``seed``, ``proposal_temperature``); a
            later request its answer could not be recorded under (a packed or sampled
            one after a default one, a smaller K, ...) raises ``RecordingError`` naming
            the option before it is sent.
        record_compression: ``"auto"`` (zstd), ``"zstd"``, ``"lz4"`` or ``"none"``.
        record_metadata: extra JSON metadata for the recording's ``metadata.json``.
        student_tokenizer: the name of a student tokenizer the teacher serves
            (``info().student_tokenizers``, its ``--student-tokenizer`` flag): every
            request sends that tokenizer's ids and gets rows in them, a row that ends
            inside a teacher token masked (docs/cross_tokenizer.md). A teacher that does
            not serve it raises TeacherMismatchError before the first request. None: the
            teacher's own tokenizer.

    The options are held checked in :attr:`settings` (a
    :class:`~student_client.clients.client_options.ClientSettings`, where their defaults
    are written). Channels are opened on first use, inside the running event loop.
    """

    def __init__(self, target: str | Sequence[str], **options: Unpack[ClientOptions]) -> None:
        self.settings = settings = ClientSettings(**options)
        token = settings.token
        connecting = Connecting(
            credentials=channel_credentials(settings.tls),
            tls_server_name=settings.tls_server_name,
            max_message_bytes=settings.max_message_bytes,
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            timeout_s=settings.timeout_s,
        )
        retry = RetryPolicy(settings.retries + 1, settings.backoff_s, settings.max_backoff_s)
        self._targets = TargetSet(parse_targets(target), connecting, retry, self._check_info)
        self.targets = self._targets.targets
        self._stream_loop = StreamLoop(self._targets, self._record_answer)
        self._recorder = AnswerRecorder(
            settings.record_to, settings.record_compression, settings.record_metadata
        )
        self._ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._closed = False

    # -- targets, info and retries ----------------------------------------------------
    @property
    def names(self) -> list[str]:
        """``[]``: one teacher (see
        :class:`~student_client.clients.sources.AsyncTeacherSource`)."""
        return []

    @property
    def current_target(self) -> str:
        """The target the latest call went to."""
        return self.targets[self._targets.current]

    def _check_info(self, target: str, msg: pb.TeacherInfo) -> tuple[TeacherInfo, pb.TeacherInfo]:
        """A target's ``GetInfo`` checked (our schema, the teacher the student expects;
        with a student tokenizer: as its requests see it), and as its answers are
        recorded with."""
        info = TeacherInfo.from_message(msg)
        info.check_schema()
        student = self.settings.student_tokenizer
        if student is not None:  # its ids are the student tokenizer's
            info = info.for_student(student)
            msg = _as_student(msg, info)
        info.check_expected(f"teacher {target}", **self.settings.expected)
        return info, msg

    async def info(self) -> TeacherInfo:
        """The teacher's ``GetInfo`` (checked against the expected vocabulary)."""
        return await self._targets.call(self._targets.fetch_info, self._targets.current)

    # -- recording ----------------------------------------------------------------------
    def _record_answer(self, index: int, asm: ResponseAssembler) -> None:
        """Write one answered request to the recording (when recording)."""
        self._recorder.write(asm, self._targets.info_message(index), self.targets)

    # -- score --------------------------------------------------------------------------
    def _request(self, batch: Any, options: RequestOptions) -> Outgoing:
        """A batch of sequences, a ``BatchEncoding`` / dict, or a :class:`ScoreBatch` ->
        ScoreRequest with a new id (padding cut off) and the layout :meth:`decode` places
        its answer into (it travels with the request's answer, nowhere else)."""
        item = batch if isinstance(batch, ScoreBatch) else ScoreBatch(batch)
        asked = item.request_options(options)
        student = self.settings.student_tokenizer
        if student is not None:
            if asked.student_tokenizer not in (None, student):
                raise ValueError(
                    f"student_tokenizer: the request names {asked.student_tokenizer!r}, this "
                    f"client sends {student!r} ids"
                )
            asked = replace(asked, student_tokenizer=student)
        self._recorder.check(asked)  # refused before the teacher works, by name
        request, layout = build_aligned_request(
            item.sequences,
            asked,
            attention_mask=item.attention_mask,
            positions=item.positions,
            request_id=next(self._ids),
            candidate_ids=item.candidate_ids,
        )
        size = request.ByteSize()
        if size > self.settings.max_message_bytes:  # gRPC would refuse it with a bare status
            raise ResourceExhaustedError(
                f"request: {size} bytes (token ids and candidate ids) exceeds the client's "
                f"max_message_mb {self.settings.max_message_bytes >> 20} MiB; split the batch",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        return request, layout, asked

    def decode(self, answer: Answer, device: torch.device | str) -> TeacherPayload:
        """A complete answer's tensors on ``device``, placed into its batch's padded
        ``[B, T]`` layout when the batch came with an attention mask."""
        return align(answer.response.payload(device), answer.layout)

    def _deadline(self, timeout_s: float | None) -> float:
        return self.settings.timeout_s if timeout_s is None else positive("timeout_s", timeout_s)

    async def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[LiveScoreKeywords],
    ) -> TeacherPayload:
        """Score one batch; returns ``[B, S, K]`` tensors (see :class:`TeacherPayload`).

        Args:
            sequences: ``[B, L]`` tensor/array, a list of 1-D token id sequences, or a
                tokenizer's ``BatchEncoding`` / a dict with ``input_ids`` (and
                ``attention_mask``).
            top_k: K, or the whole :class:`~topk_protocol.RequestOptions`; None with
                ``samples=N`` (a sampled payload's K is N).
            options: the other request options by keyword
                (:class:`~topk_protocol.requests.RequestKeywords`, ``RequestOptions.of``):
                ``dtype``, the wire dtype of the log-probs (``float16`` by default,
                ``bfloat16``, ``float32``; the payload holds them widened to float32),
                and ``include_sampled`` (default True: also fetch the log-prob of the
                actual next token).
            positions: None (every position) or ``(start, end)`` per sequence (with an
                attention mask: column ranges of the padded batch).
            device: where the tensors go.
            timeout_s: this call's deadline (default: the client's).
            teacher: ignored (one teacher; a multi-teacher client routes by it).
            attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding (right or left).
                Padding is not sent; the payload comes back as ``[B, T, K]`` aligned to
                the padded batch, ``mask`` False on padding (:mod:`student_client.data.alignment`).
            candidate_ids: ids whose exact teacher log-probs to fetch at every scored
                position (e.g. the student's own top-C), laid out like the payload this
                call returns: ``[B, S, C]`` (row ``j`` of sequence ``b`` is position
                ``positions[b][0] + j``; rows past a sequence's positions are ignored)
                or one ``[S_b, C]`` per sequence, or, with an attention mask, ``[B, T, C]``
                (column ``t`` of the padded batch); int ids in ``[0, V)``, ``-1`` pads.
                The payload then has ``candidate_ids`` / ``candidate_logprobs``
                ``[B, S, C]`` (NaN at ``-1``). Needs ``C <= info().max_candidates``.
        """
        call = split_call(sequences, keywords)
        timeout = self._deadline(call.timeout_s)
        request, layout, asked = self._request(call.batch, RequestOptions.of(top_k, **call.options))

        targets = self._targets

        async def unary(index: int) -> Answer:
            await targets.fetch_info(index)
            asm = ResponseAssembler(request, asked)
            metadata = targets.connecting.metadata
            asm.add(await targets.stub(index).Score(request, timeout=timeout, metadata=metadata))
            self._record_answer(index, asm)
            return Answer(asm, layout)

        info = await targets.call(targets.fetch_info, targets.next_index())
        ours = self.settings.max_message_bytes
        limit = min(ours, info.max_message_bytes or ours)
        if not fits_one_message(
            response_bytes(request, info.vocab_size, asked), len(request.sequences), limit
        ):
            gen = self._stream_loop.run(as_async([(request, layout, asked)]), 0, timeout)
            try:
                return self.decode(await anext(gen), call.device)
            finally:
                await gen.aclose()
        return self.decode(await targets.call(unary, targets.current), call.device)

    # -- stream -------------------------------------------------------------------------
    def stream_answers(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[AnswerKeywords],
    ) -> AsyncIterator[Answer]:
        """The complete answers to ``batches``, in input order, undecoded (each one's
        ``payload(device)`` gives the tensors); :meth:`stream` decodes them on the loop,
        the blocking client in the caller's thread while the loop reads on.

        ``batches`` (an iterable or an async iterable) yields batches of sequences (as
        for :meth:`score`, ``BatchEncoding`` / dicts included) or :class:`ScoreBatch` items
        (with positions, attention mask); it is consumed
        lazily, at most ``depth`` batches ahead of the payload the caller holds. While the
        caller works on payload ``n``, requests ``n+1 .. n+depth`` are with the teacher
        (``depth=0``: none, every request waits for the caller). A request the teacher
        refused raises its typed exception when the caller reaches that batch, which
        ends the iteration. ``top_k`` and the request ``options`` (``dtype``,
        ``include_sampled``, ...), ``timeout_s``: as :meth:`score` (``timeout_s`` counts
        per request, from when it is sent).
        """
        call = split_stream(keywords)
        check_depth(call.depth)
        timeout = self._deadline(call.timeout_s)
        opts = RequestOptions.of(top_k, **call.options)

        async def requests() -> AsyncIterator[Outgoing | TeacherError]:
            async for batch in as_async(batches):
                try:
                    yield self._request(batch, opts)
                except TeacherError as e:  # raised when the caller reaches this batch
                    yield e

        return self._stream_loop.run(requests(), call.depth, timeout)

    # -- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        """Close the channels and finish the recording (last rows flushed)."""
        if self._closed:
            return
        self._closed = True
        self._recorder.close()
        await self._targets.close()


def _as_student(msg: pb.TeacherInfo, info: TeacherInfo) -> pb.TeacherInfo:
    """``GetInfo`` as a student tokenizer's requests see it (``info``'s vocabulary size
    and fingerprint), as a recording of its answers stores it."""
    out = pb.TeacherInfo()
    out.CopyFrom(msg)
    out.vocab_size = info.vocab_size
    out.tokenizer_fingerprint = info.tokenizer_fingerprint
    return out
