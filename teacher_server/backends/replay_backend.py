"""Replay backend: serve a recording (``teacher-server serve --backend replay``).

A recording (:mod:`topk_protocol.recording`) holds rows per sequence, looked up by the
sequence's token ids whatever batch it was recorded in. Before scoring, every request is
checked as a whole (:meth:`ReplayBackend.check_request`): each sequence must have a
recorded row covering its positions, with sampled log-probs when they are asked for (a
row without them is passed over for another copy that has them), K' <= the recorded K
and a dtype the recorded values reproduce exactly. Otherwise the answer is NOT_FOUND
naming every sequence and what is missing: never NaN or zeros in place of requested data.
A recorded row that fails its checksum (every copy of it) is DATA_LOSS naming the shard
and the row; the intact rows are served.
The recorded values go out through the server's own encoding, so answers are
byte-identical to the teacher's. GetInfo announces the recorded teacher's temperature.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import numpy.typing as npt

from teacher_server.backends.base import Backend, BackendInfo, ScoredSequence
from teacher_server.validation import RequestError
from topk_protocol import dtype_name, teacher_temperature
from topk_protocol.errors import RecordingDamagedError
from topk_protocol.recording import RecordedSequence, RecordingReader, can_serve_dtype

if TYPE_CHECKING:
    from teacher_server.validation import ParsedRequest

__all__ = ["ReplayBackend"]


def _describe(token_ids: npt.NDArray[np.int32], max_tokens: int = 8) -> str:
    first = ", ".join(map(str, np.asarray(token_ids[:max_tokens]).tolist()))
    more = ", ..." if len(token_ids) > max_tokens else ""
    return f"sequence of {len(token_ids)} tokens starting [{first}{more}]"


class ReplayBackend(Backend):
    """Answers from a recording directory.

    Args:
        path: the recording (:mod:`topk_protocol.recording`).
        max_top_k: largest K the server announces (default: the recorded teacher's);
            a K above the recorded one is refused with NOT_FOUND.
    """

    def __init__(self, path: str | Path, *, max_top_k: int | None = None) -> None:
        self._path = Path(path)
        self._max_top_k = max_top_k
        self._reader: RecordingReader | None = None

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
        )

    @property
    def reader(self) -> RecordingReader:
        if self._reader is None:
            raise RuntimeError("replay backend: not started")
        return self._reader

    @property
    def num_sequences(self) -> int:
        """Recorded rows."""
        return len(self.reader)

    async def warmup(self) -> None:
        """Nothing to warm up (and the warm-up sequence is not recorded)."""

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _not_found(self, message: str) -> RequestError:
        return RequestError(
            grpc.StatusCode.NOT_FOUND, f"replay: not recorded in {self._path.name}: {message}"
        )

    def check_request(self, parsed: ParsedRequest) -> None:
        """Refuse with NOT_FOUND anything the recording cannot answer exactly."""
        reader = self.reader
        dtype = dtype_name(parsed.dtype)
        if parsed.top_k > reader.top_k:
            raise self._not_found(f"top_k {parsed.top_k}: the recorded K is {reader.top_k}")
        if not can_serve_dtype(reader.dtype, dtype):
            raise self._not_found(
                f"dtype {dtype}: the recording holds {reader.dtype} log-probs, which do not "
                f"give the teacher's {dtype} values exactly"
            )
        problems = []
        for i, seq in enumerate(parsed.sequences):
            if seq.start == seq.end:
                continue
            try:
                found = reader.find(
                    np.asarray(seq.token_ids, dtype="<i4").tobytes(),
                    seq.start,
                    seq.end,
                    parsed.include_sampled,
                )
            except RecordingDamagedError as e:  # every recorded copy is damaged
                raise RequestError(
                    grpc.StatusCode.DATA_LOSS, f"replay: sequences[{i}]: {e}"
                ) from None
            if isinstance(found, str):
                problems.append(f"sequences[{i}] ({_describe(seq.token_ids)}): {found}")
        if problems:
            raise self._not_found(f"at top_k {parsed.top_k}: " + "; ".join(problems))

    def _row(
        self, token_ids: npt.NDArray[np.int32], top_k: int, start: int, end: int
    ) -> RecordedSequence:
        ids = np.asarray(token_ids, dtype="<i4").tobytes()
        # A copy with sampled log-probs first; one without serves requests not asking for
        # them (check_request refused the others before any scoring).
        try:
            found = self.reader.find(ids, start, end, True)
            if isinstance(found, str):
                found = self.reader.find(ids, start, end, False)
        except RecordingDamagedError as e:
            raise RequestError(grpc.StatusCode.DATA_LOSS, f"replay: {e}") from None
        if isinstance(found, str) or top_k > self.reader.top_k:
            raise self._not_found(
                f"{_describe(token_ids)} at top_k {top_k}, positions [{start}, {end})"
            )
        return found

    async def score(
        self, token_ids: npt.NDArray[np.int32], top_k: int, start: int, end: int
    ) -> ScoredSequence:
        row = self._row(token_ids, top_k, start, end)
        rows = slice(start - row.start, end - row.start)
        n = end - start
        sampled = (
            row.sampled_logprobs[rows].astype(np.float32)
            if row.sampled_logprobs is not None
            # Only reached when the request does not ask for them (see check_request).
            else np.full(n, np.nan, np.float32)
        )
        return ScoredSequence(
            np.ascontiguousarray(row.ids[rows, :top_k]),
            row.logprobs[rows, :top_k].astype(np.float32),
            sampled,
            start,
        )
