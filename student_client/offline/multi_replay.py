"""``MultiReplayClient``: a multi-teacher recording, answered as the multi-teacher client did.

A multi-teacher recording (:mod:`topk_protocol.recording.multi_recording`) holds one recording per
teacher. ``score(..., teacher=[...])`` / ``ScoreBatch(teacher=...)`` route each sequence to
its teacher's recording (the routing of the live client, :mod:`student_client.clients.routing`),
each part is answered by that teacher's :class:`~student_client.offline.replay_client.ReplayClient`,
and the payload's ``teachers`` names the teacher of every row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from typing_extensions import Unpack

from student_client.clients.routing import check_agreement, merge_payloads, name_error, plan_routes
from student_client.data.batch import ScoreKeywords, StreamKeywords, split_call
from student_client.data.payload import TeacherPayload
from student_client.offline.replay_client import ReplayClient, replay_stream
from topk_protocol import RequestOptions, TeacherInfo
from topk_protocol._closeable import Closeable
from topk_protocol.errors import NotRecordedError, TeacherError
from topk_protocol.recording.multi_recording import read_manifest, recorded_teachers

__all__ = ["MultiReplayClient"]


class MultiReplayClient(Closeable):
    """Serves ``info``/``score``/``stream`` from a multi-teacher recording (a
    :class:`~student_client.clients.sources.TeacherSource` whose ``names`` are the
    recording's teachers).

    Args:
        path: the multi-teacher recording directory.
        expect_vocab_size, expect_tokenizer_fingerprint, expect_temperature: checked
            against every recorded teacher at open (as :class:`ReplayClient`).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        expect_vocab_size: int | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        expect_temperature: float | None = None,
    ) -> None:
        self._root = Path(path)
        self._teachers: dict[str, ReplayClient] = {}
        names = read_manifest(path)
        if names is None:
            raise ValueError(
                f"path: {path} is a single-teacher recording: open it with ReplayClient(path)"
            )
        #: Every teacher of the manifest (routing accepts them all; some may have no rows).
        self._names = names
        recorded = recorded_teachers(path)
        if not recorded:
            raise NotRecordedError(f"recording {path}: no teacher has rows recorded")
        try:
            for name in recorded:
                self._teachers[name] = ReplayClient(
                    path,
                    teacher=name,
                    expect_vocab_size=expect_vocab_size,
                    expect_tokenizer_fingerprint=expect_tokenizer_fingerprint,
                    expect_temperature=expect_temperature,
                )
            check_agreement(
                {n: c.info() for n, c in self._teachers.items()},
                {n: [str(c.path)] for n, c in self._teachers.items()},
            )
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> Path:
        return self._root

    @property
    def names(self) -> list[str]:
        """The recording's teachers."""
        return list(self._names)

    def __len__(self) -> int:
        """Sequences (rows) in the recording, every teacher's."""
        return sum(len(c) for c in self._teachers.values())

    def info(self) -> dict[str, TeacherInfo]:
        """Each recorded teacher's ``GetInfo``."""
        return {n: c.info() for n, c in self._teachers.items()}

    def score(
        self,
        sequences: Any,
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[ScoreKeywords],
    ) -> TeacherPayload:
        """The recorded payload of this batch, each sequence from its ``teacher``'s rows
        (arguments as ``MultiTeacherClient.score``)."""
        call = split_call(sequences, keywords)
        teachers, routes = plan_routes(call.batch, self._names)
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
                    candidate_ids=r.batch.candidate_ids,
                    **call.options,
                )
            except TeacherError as e:
                raise name_error(r.teacher, e) from None
            parts.append((r.rows, part))
        merged = merge_payloads(parts, teachers)
        return merged if str(call.device) == "cpu" else merged.to(call.device)

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int | RequestOptions | None = None,
        **keywords: Unpack[StreamKeywords],
    ) -> Iterator[TeacherPayload]:
        """The recorded payloads of ``batches``, in order (see
        :func:`~student_client.offline.replay_client.replay_stream`)."""
        return replay_stream(self.score, batches, top_k, **keywords)

    def close(self) -> None:
        for c in self._teachers.values():
            c.close()
