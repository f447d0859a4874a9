"""Replay backend: serve a recording (``teacher-server serve --backend replay``).

A recording (:mod:`topk_protocol.recording`) holds rows per sequence, looked up by the
sequence's token ids whatever batch it was recorded in. Before scoring, every request is
checked as a whole (:meth:`ReplayBackend.check_request`) by the protocol's replay rules
(:mod:`topk_protocol.recording.replay`, the ones the student's ``ReplayClient`` applies too):
anything the recording cannot answer exactly raises
:class:`~topk_protocol.errors.NotRecordedError` naming every sequence and what is
missing (NOT_FOUND on the wire, reason ``not_recorded``), never NaN or zeros in place
of requested data. A recorded row that fails its checksum (every copy of it) raises
:class:`~topk_protocol.errors.RecordingDamagedError` naming the shard and the row
(DATA_LOSS on the wire); the intact rows are served. The recorded values go out through
the server's own encoding, so answers are byte-identical to the teacher's. GetInfo
announces the recorded teacher's temperature.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.validation import ParsedRequest, ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays, teacher_temperature
from topk_protocol.recording import RecordingReader
from topk_protocol.recording.multi_recording import read_manifest, teacher_recording_path
from topk_protocol.recording.replay import find_rows, recorded_arrays, serves_encodings
from topk_protocol.storage import Location, location

__all__ = ["ReplayBackend", "ReplayFlags", "replay_path"]


@dataclass(frozen=True)
class ReplayFlags:
    """The replay backend's flags (it serves the temperature the recording was made at,
    so it takes no --teacher-temperature)."""

    recording: str
    """recording directory (or URI, e.g. s3://bucket/prefix) to serve"""
    replay_teacher: str | None = field(default=None, metadata={"metavar": "NAME"})
    """with a multi-teacher recording: serve this teacher's rows"""


def replay_path(recording: str | Path, teacher: str | None) -> str | Path:
    """The recording to replay: ``recording`` itself, or one teacher's part of a
    multi-teacher recording (``ValueError`` naming what is wrong otherwise)."""
    names = read_manifest(recording)
    if names is None:
        if teacher:
            raise ValueError(
                f"--replay-teacher {teacher}: {recording} is a single-teacher recording"
            )
        return location(recording)
    if teacher not in names:
        raise ValueError(
            f"{recording} is a multi-teacher recording of {names}: pass --replay-teacher "
            f"NAME (got {teacher!r})"
        )
    return teacher_recording_path(recording, teacher)


class ReplayBackend(Backend):
    """Answers from a recording directory.

    Args:
        path: the recording (:mod:`topk_protocol.recording`).
        max_top_k: largest K the server announces (default: the recorded teacher's);
            a K above the recorded one is refused with NOT_FOUND.
    """

    def __init__(self, path: str | Path, *, max_top_k: int | None = None) -> None:
        self._path = Location.of(path)
        self._max_top_k = max_top_k
        self._reader: RecordingReader | None = None

    Flags = ReplayFlags
    #: Why a flag of another backend is refused here (the CLI says so).
    flag_notes: ClassVar[dict[str, str]] = {
        "teacher_temperature": "replay serves the temperature the recording was made at",
    }

    @classmethod
    def from_flags(cls, flags: ReplayFlags, *, max_top_k: int) -> ReplayBackend:
        return cls(replay_path(flags.recording, flags.replay_teacher), max_top_k=max_top_k)

    async def start(self) -> None:
        self._reader = await asyncio.to_thread(RecordingReader, self._path)
        info = self._reader.info
        self.info = BackendInfo(
            model_name=info.model_name,
            vocab_size=int(info.vocab_size),
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            max_top_k=self._max_top_k or int(info.max_top_k) or self._reader.top_k,
            max_sequence_length=int(info.max_sequence_length),
            name="replay",
            temperature=teacher_temperature(info),
            # Any C: what the recording does not hold is NOT_FOUND, never made up.
            max_candidates=int(info.vocab_size),
            max_samples=int(self._reader.options.get("samples", 0)),  # a sampled recording's N
        )

    @property
    def reader(self) -> RecordingReader:
        if self._reader is None:
            raise RuntimeError("replay backend: not started")
        return self._reader

    @property
    def _where(self) -> str:
        # The directory's name only: the server's file system is not the client's business.
        return f"recording {self._path.name}"

    async def warmup(self) -> None:
        """Nothing to warm up (and the warm-up sequence is not recorded)."""

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _rows(
        self, sequences: list[ParsedSequence], options: RequestOptions
    ) -> list[SequenceArrays | None]:
        keys = [
            (np.asarray(s.token_ids, dtype="<i4").tobytes(), s.start, s.end, s.candidate_ids)
            for s in sequences
        ]
        return find_rows(self.reader, keys, options, self._where)

    @property
    def supported_encodings(self) -> tuple[str, ...]:
        """What the recording answers exactly (``serves_encodings``)."""
        return serves_encodings(self.reader)

    def check_request(self, parsed: ParsedRequest) -> None:
        """Refuse (:class:`NotRecordedError`) anything the recording cannot answer exactly."""
        self._rows(parsed.sequences, parsed.options)

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        (row,) = self._rows([sequence], options)
        return recorded_arrays(row, sequence.start, sequence.end, options, sequence.candidate_ids)
