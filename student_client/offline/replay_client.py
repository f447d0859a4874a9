"""``ReplayClient``: the client interface, answered from a recording instead of a teacher.

Any batch composition and order, any K' <= the recorded K (rows are sorted, so the top-K'
is the recorded row's prefix), any position sub-range inside a recorded one, and any
dtype the teacher would have cast from the recorded values (see
:func:`~topk_protocol.recording.can_serve_dtype`) are answered byte-identically to the
live teacher: the recorded values go through the teacher's own encoding and the client's
own decoding. Anything else raises :class:`~topk_protocol.errors.NotRecordedError`
naming the sequence and what is missing; never NaN or zeros in place of data.

A multi-teacher recording (:mod:`topk_protocol.recording.multi_recording`) replays through
:class:`~student_client.offline.multi_replay.MultiReplayClient`;
``ReplayClient(path, teacher=name)`` opens one teacher's part as a single-teacher
recording.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from typing_extensions import Unpack

from student_client.data.alignment import align, build_aligned_request
from student_client.data.assembler import ResponseAssembler
from student_client.data.batch import ScoreBatch, ScoreKeywords, StreamKeywords, split_call
from student_client.data.payload import TeacherPayload
from topk_protocol import (
    RequestOptions,
    TeacherInfo,
    check_temperature,
    encode_sequence,
    pb,
    request_spans,
)
from topk_protocol._closeable import Closeable
from topk_protocol.checks import (
    TeacherLimits,
    check_candidates,
    check_depth,
    check_token_ids,
    check_top_k,
)
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingReader
from topk_protocol.recording.multi_recording import (
    read_manifest,
    recorded_teachers,
    teacher_recording_path,
)
from topk_protocol.recording.replay import find_rows, recorded_arrays, serves_encodings
from topk_protocol.requests import RequestKeywords

__all__ = ["ReplayClient", "replay_response", "replay_stream"]


def replay_response(
    reader: RecordingReader, request: pb.ScoreRequest, options: RequestOptions | None = None
) -> pb.ScoreResponse:
    """The answer the teacher would have sent to ``request``, from recorded rows
    (``options``: the ones the request was built with; None: read back from it).

    Raises :class:`NotRecordedError` naming every sequence that cannot be answered
    exactly and why (the rules of :mod:`topk_protocol.recording.replay`).
    """
    if options is None:
        options = RequestOptions.from_proto(request)
    spans = request_spans(request)
    cands = [
        np.frombuffer(seq.candidate_ids, dtype="<i4").reshape(end - start, seq.num_candidates)
        if seq.num_candidates
        else None
        for seq, (start, end) in zip(request.sequences, spans, strict=True)
    ]
    keys = [
        (seq.token_ids, start, end, cand)
        for seq, (start, end), cand in zip(request.sequences, spans, cands, strict=True)
    ]
    rows = find_rows(reader, keys, options, f"recording {reader.path}")
    out = pb.ScoreResponse(request_id=request.request_id, final=True)
    packing = options.packing(int(reader.info.vocab_size))
    for i, (row, (start, end)) in enumerate(zip(rows, spans, strict=True)):
        arrays = recorded_arrays(row, start, end, options, cands[i])
        out.sequences.append(
            encode_sequence(arrays, dtype=options.wire_dtype, sequence_index=i, packing=packing)
        )
    return out


def replay_stream(
    score: Callable[..., TeacherPayload],
    batches: Iterable[Any],
    top_k: int | RequestOptions | None = None,
    *,
    depth: int = 4,
    device: torch.device | str = "cpu",
    **options: Unpack[RequestKeywords],
) -> Iterator[TeacherPayload]:
    """``score`` of each of ``batches`` (batches or :class:`ScoreBatch` items), in order,
    read lazily: a replay client's ``stream``. ``depth`` is accepted for interface parity
    with the live clients (there is nothing to prefetch)."""
    check_depth(depth)
    opts = RequestOptions.of(top_k, **options)
    for batch in batches:
        item = batch if isinstance(batch, ScoreBatch) else ScoreBatch(batch)
        yield score(
            item.sequences,
            item.request_options(opts),
            positions=item.positions,
            device=device,
            attention_mask=item.attention_mask,
            teacher=item.teacher,
            candidate_ids=item.candidate_ids,
        )


class ReplayClient(Closeable):
    """Serves ``info``/``score``/``stream`` from a recording directory (a
    :class:`~student_client.clients.sources.TeacherSource`).

    Args:
        path: the recording (see :mod:`topk_protocol.recording`).
        teacher: with a multi-teacher recording, the teacher whose part to open (a
            whole multi-teacher recording is
            :class:`~student_client.offline.multi_replay.MultiReplayClient`'s).
        expect_vocab_size, expect_tokenizer_fingerprint: checked against the recorded
            teacher's info at open; a mismatch raises VocabMismatchError.
        expect_temperature: the teacher temperature the student expects (None: any); a
            recording of another one raises TeacherMismatchError.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        teacher: str | None = None,
        expect_vocab_size: int | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        expect_temperature: float | None = None,
    ) -> None:
        if expect_temperature is not None:
            expect_temperature = check_temperature(expect_temperature, "expect_temperature")
        names = read_manifest(path)
        if names is not None and teacher is None:
            raise ValueError(
                f"path: {path} is a multi-teacher recording of {names}: open it whole with "
                "MultiReplayClient(path), or one teacher's part with "
                "ReplayClient(path, teacher=NAME)"
            )
        if teacher is not None:
            if names is None or teacher not in recorded_teachers(path):
                raise NotRecordedError(
                    f"teacher: {teacher!r} is not recorded in {path} "
                    f"({'teachers ' + str(names) if names else 'a single-teacher recording'})"
                )
            path = teacher_recording_path(path, teacher)
        self._reader = RecordingReader(path)
        self._info = replace(
            TeacherInfo.from_message(self._reader.info),
            supported_encodings=serves_encodings(self._reader),
        )
        try:
            self._info.check_schema()
            self._info.check_expected(
                f"recording {path}",
                vocab_size=expect_vocab_size,
                tokenizer_fingerprint=expect_tokenizer_fingerprint,
                temperature=expect_temperature,
            )
        except BaseException:
            self._reader.close()
            raise

    @property
    def path(self) -> str | Path:
        """The recording (a ``Path``, or the URI string)."""
        return self._reader.path

    @property
    def names(self) -> list[str]:
        """``[]``: one teacher (see :class:`~student_client.clients.sources.TeacherSource`)."""
        return []

    def __len__(self) -> int:
        """Sequences (rows) in the recording."""
        return len(self._reader)

    def info(self) -> TeacherInfo:
        """The recorded teacher's ``GetInfo``."""
        return self._info

    def _check(self, request: pb.ScoreRequest) -> None:
        """The checks of the live teacher that do not need the engine (the same
        functions and messages: :mod:`topk_protocol.checks`). Any C of candidates is
        looked up: what the recording does not hold is not recorded (NotRecordedError)."""
        limits = replace(
            TeacherLimits.of_info(self._info), max_candidates=int(self._info.vocab_size)
        )
        if limits.max_top_k:
            check_top_k(int(request.top_k), limits)
        for i, (seq, (start, end)) in enumerate(
            zip(request.sequences, request_spans(request), strict=True)
        ):
            ids = np.frombuffer(seq.token_ids, dtype="<i4")
            check_token_ids(ids, limits, f"sequences[{i}].token_ids")
            check_candidates(
                seq.candidate_ids,
                int(seq.num_candidates),
                end - start,
                limits,
                f"sequences[{i}].candidate_ids",
                int(request.samples),
            )

    def _answer(
        self, request: pb.ScoreRequest, options: RequestOptions, device: torch.device | str
    ) -> TeacherPayload:
        self._check(request)
        asm = ResponseAssembler(request, options)
        asm.add(replay_response(self._reader, request, options))
        return asm.payload(device)

    def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[ScoreKeywords],
    ) -> TeacherPayload:
        """The recorded payload of this batch (arguments as ``TeacherClient.score``;
        ``teacher`` is ignored, as by a single-teacher client)."""
        call = split_call(sequences, keywords)
        asked = RequestOptions.of(top_k, **call.options)
        request, layout = build_aligned_request(
            sequences,
            asked,
            attention_mask=call.batch.attention_mask,
            positions=call.batch.positions,
            candidate_ids=call.batch.candidate_ids,
        )
        return align(self._answer(request, asked, call.device), layout)

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[StreamKeywords],
    ) -> Iterator[TeacherPayload]:
        """The recorded payloads of ``batches``, in order (see :func:`replay_stream`)."""
        return replay_stream(self.score, batches, top_k, **keywords)

    def close(self) -> None:
        if hasattr(self, "_reader"):
            self._reader.close()
