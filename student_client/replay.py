"""``ReplayClient``: the client interface, answered from a recording instead of a teacher.

Any batch composition and order, any K' <= the recorded K (rows are sorted, so the top-K'
is the recorded row's prefix), any position sub-range inside a recorded one, and any
dtype the teacher would have cast from the recorded values (see
:func:`~topk_protocol.recording.can_serve_dtype`) are answered byte-identically to the
live teacher: the recorded values go through the teacher's own encoding and the client's
own decoding. Anything else raises :class:`~student_client.errors.NotRecordedError`
naming the sequence and what is missing; never NaN or zeros in place of data.

A multi-teacher recording (:mod:`topk_protocol.multi_recording`) replays as the
multi-teacher client answered: ``score(..., teacher=[...])`` / ``ScoreBatch(teacher=...)``
route each sequence to its teacher's recording (:mod:`student_client.routing`), and the
payload's ``teachers`` names them; ``ReplayClient(path, teacher=name)`` opens one
teacher's part as a single-teacher recording.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from student_client.aio_client import ScoreBatch
from student_client.alignment import align, build_aligned_request
from student_client.errors import NotRecordedError, TeacherError
from student_client.payload import ResponseAssembler, TeacherPayload
from student_client.routing import check_agreement, merge_payloads, name_error, plan_routes
from topk_protocol import (
    RequestOptions,
    TeacherInfo,
    check_temperature,
    encode_sequence,
    pb,
    request_spans,
)
from topk_protocol._closeable import Closeable
from topk_protocol.checks import TeacherLimits, check_depth, check_token_ids, check_top_k
from topk_protocol.multi_recording import (
    read_manifest,
    recorded_teachers,
    teacher_recording_path,
)
from topk_protocol.recording import RecordingReader
from topk_protocol.replay import find_rows, recorded_arrays

__all__ = ["ReplayClient", "replay_response"]


def replay_response(reader: RecordingReader, request: pb.ScoreRequest) -> pb.ScoreResponse:
    """The answer the teacher would have sent to ``request``, from recorded rows.

    Raises :class:`NotRecordedError` naming every sequence that cannot be answered
    exactly and why (the rules of :mod:`topk_protocol.replay`).
    """
    options = RequestOptions.from_proto(request)
    spans = request_spans(request)
    keys = [
        (seq.token_ids, start, end)
        for seq, (start, end) in zip(request.sequences, spans, strict=True)
    ]
    rows = find_rows(reader, keys, options, f"recording {reader.path}")
    out = pb.ScoreResponse(request_id=request.request_id, final=True)
    for i, (row, (start, end)) in enumerate(zip(rows, spans, strict=True)):
        ids, lps, sampled = recorded_arrays(row, start, end, options)
        out.sequences.append(
            encode_sequence(
                ids,
                lps,
                sampled,
                dtype=options.wire_dtype,
                position_start=start,
                sequence_index=i,
            )
        )
    return out


class ReplayClient(Closeable):
    """Serves ``info``/``score``/``stream`` from a recording directory.

    Args:
        path: the recording (see :mod:`topk_protocol.recording`), or a multi-teacher
            recording (then ``score`` / ``stream`` route by ``teacher``, and ``info``
            gives ``{name: TeacherInfo}``).
        teacher: open only this teacher of a multi-teacher recording.
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
        expect: dict[str, Any] = {
            "expect_vocab_size": expect_vocab_size,
            "expect_tokenizer_fingerprint": expect_tokenizer_fingerprint,
            "expect_temperature": expect_temperature,
        }
        self._root = Path(path)
        #: name -> that teacher's replay, for a multi-teacher recording opened whole.
        self._teachers: dict[str, ReplayClient] = {}
        names = read_manifest(path)
        #: Every teacher of the manifest (routing accepts them all; some may have no rows).
        self._names = names or []
        if names is not None and teacher is None:
            if not recorded_teachers(path):
                raise NotRecordedError(f"recording {path}: no teacher has rows recorded")
            try:
                for name in recorded_teachers(path):
                    self._teachers[name] = ReplayClient(
                        teacher_recording_path(path, name), **expect
                    )
                check_agreement(
                    {n: c.info() for n, c in self._teachers.items()},
                    {n: [str(c.path)] for n, c in self._teachers.items()},
                )
            except BaseException:
                self.close()
                raise
            return
        if teacher is not None:
            if names is None or teacher not in recorded_teachers(path):
                raise NotRecordedError(
                    f"teacher: {teacher!r} is not recorded in {path} "
                    f"({'teachers ' + str(names) if names else 'a single-teacher recording'})"
                )
            path = teacher_recording_path(path, teacher)
        self._reader = RecordingReader(path)
        self._info = TeacherInfo.from_message(self._reader.info)
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
    def path(self) -> Path:
        return self._root if self._teachers else self._reader.path

    @property
    def names(self) -> list[str]:
        """The teachers of a multi-teacher recording opened whole (else empty)."""
        return list(self._names) if self._teachers else []

    def __len__(self) -> int:
        """Sequences (rows) in the recording."""
        if self._teachers:
            return sum(len(c) for c in self._teachers.values())
        return len(self._reader)

    def info(self) -> Any:
        """The recorded teacher's ``GetInfo`` (``{name: TeacherInfo}`` for a multi-teacher
        recording opened whole)."""
        if self._teachers:
            return {n: c.info() for n, c in self._teachers.items()}
        return self._info

    def _check(self, request: pb.ScoreRequest) -> None:
        """The checks of the live teacher that do not need the engine (the same
        functions and messages: :mod:`topk_protocol.checks`)."""
        limits = TeacherLimits.of_info(self._info)
        if limits.max_top_k:
            check_top_k(int(request.top_k), limits)
        for i, seq in enumerate(request.sequences):
            ids = np.frombuffer(seq.token_ids, dtype="<i4")
            check_token_ids(ids, limits, f"sequences[{i}].token_ids")

    def _answer(self, request: pb.ScoreRequest, device: torch.device | str) -> TeacherPayload:
        self._check(request)
        asm = ResponseAssembler(request)
        asm.add(replay_response(self._reader, request))
        return asm.payload(device)

    def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions,
        *,
        positions: Sequence[tuple[int, int]] | None = None,
        device: torch.device | str = "cpu",
        attention_mask: Any = None,
        teacher: Any = None,
        **options: Any,
    ) -> TeacherPayload:
        """The recorded payload of this batch (arguments as ``TeacherClient.score``;
        ``teacher`` as ``MultiTeacherClient.score``, used by a multi-teacher recording)."""
        if self._teachers:
            item = ScoreBatch(sequences, positions, attention_mask, teacher)
            teachers, routes = plan_routes(item, self._names)
            parts = []
            for r in routes:
                try:
                    if r.teacher not in self._teachers:
                        raise NotRecordedError(f"recording {self._root}: nothing recorded")
                    part = self._teachers[r.teacher].score(
                        r.batch.sequences,
                        top_k,
                        positions=r.batch.positions,
                        attention_mask=r.batch.attention_mask,
                        **options,
                    )
                except TeacherError as e:
                    raise name_error(r.teacher, e) from None
                parts.append((r.rows, part))
            merged = merge_payloads(parts, teachers)
            return merged if str(device) == "cpu" else merged.to(device)
        request, layout = build_aligned_request(
            sequences, top_k, attention_mask=attention_mask, positions=positions, **options
        )
        return align(self._answer(request, device), layout)

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int | RequestOptions,
        *,
        depth: int = 4,
        device: torch.device | str = "cpu",
        **options: Any,
    ) -> Iterator[TeacherPayload]:
        """The recorded payloads of ``batches``, in order, read lazily (``depth`` is
        accepted for interface parity; there is nothing to prefetch)."""
        check_depth(depth)
        opts = RequestOptions.of(top_k, **options)
        for batch in batches:
            item = batch if isinstance(batch, ScoreBatch) else ScoreBatch(batch)
            yield self.score(
                item.sequences,
                opts,
                positions=item.positions,
                device=device,
                attention_mask=item.attention_mask,
                teacher=item.teacher,
            )

    def close(self) -> None:
        for c in self._teachers.values():
            c.close()
        if not self._teachers and hasattr(self, "_reader"):
            self._reader.close()
