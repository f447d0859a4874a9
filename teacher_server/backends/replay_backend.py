"""Replay backend: serve a recording (``teacher-server serve --backend replay``).

At start every record is read once to build a per-sequence index: sha256 of (token ids,
K, start, end) -> (record offset, sequence index). ``score`` looks a sequence up there,
whatever batch it was recorded in, and decodes the recorded rows to float32; the server
encodes them back to the asked dtype. float16 and bfloat16 widen to float32 exactly, so
an answer is bit-exact when the sequence was recorded in float32 or in the asked dtype.
When a sequence was recorded several times, the most precise copy wins (float32 >
float16 > bfloat16, then one with sampled log-probs). A sequence that is not recorded is
refused with NOT_FOUND naming it.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt

from student_client.payload import request_dtype, request_includes_sampled, request_spans
from student_client.recording import RecordingReader, sequence_key
from student_client.wire import decode_sequence, pb
from teacher_server.backends.base import Backend, BackendInfo, ScoredSequence
from teacher_server.validation import RequestError

__all__ = ["ReplayBackend"]

_DTYPE_RANK: dict[int, int] = {
    pb.LOGPROB_DTYPE_FLOAT32: 3,
    pb.LOGPROB_DTYPE_FLOAT16: 2,
    pb.LOGPROB_DTYPE_BFLOAT16: 1,
}
_RECORD_CACHE = 32  # decoded records kept (a batch's sequences share one record)


class ReplayBackend(Backend):
    """Answers from a recording file.

    Args:
        path: the recording (:mod:`student_client.recording`).
        max_top_k: largest K the server announces (requests for a K that was not
            recorded are refused with NOT_FOUND anyway).
    """

    def __init__(self, path: str | Path, *, max_top_k: int = 64) -> None:
        self._path = Path(path)
        self._max_top_k = max_top_k
        self._reader: RecordingReader | None = None
        # sequence key -> (rank, record offset, sequence index)
        self._index: dict[bytes, tuple[tuple[int, int], int, int]] = {}

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        reader = RecordingReader(self._path)
        self._reader = reader
        self._read = functools.lru_cache(maxsize=_RECORD_CACHE)(reader.read_at)
        for offset in reader.offsets():
            request, _ = reader.read_at(offset)
            rank = (_DTYPE_RANK[request_dtype(request)], int(request_includes_sampled(request)))
            for i, (seq, (start, end)) in enumerate(
                zip(request.sequences, request_spans(request), strict=True)
            ):
                key = sequence_key(seq.token_ids, int(request.top_k), start, end)
                best = self._index.get(key)
                if best is None or rank > best[0]:
                    self._index[key] = (rank, offset, i)
        info = reader.info
        self.info = BackendInfo(
            model_name=info.model_name,
            vocab_size=int(info.vocab_size),
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            max_top_k=self._max_top_k,
            max_sequence_length=int(info.max_sequence_length),
            name="replay",
        )

    @property
    def num_sequences(self) -> int:
        """Distinct (sequence, K, positions) entries in the index."""
        return len(self._index)

    async def warmup(self) -> None:
        """Nothing to warm up (and the warm-up sequence is not recorded)."""

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def score(
        self, token_ids: npt.NDArray[np.int32], top_k: int, start: int, end: int
    ) -> ScoredSequence:
        ids_bytes = np.asarray(token_ids, dtype="<i4").tobytes()
        entry = self._index.get(sequence_key(ids_bytes, top_k, start, end))
        if entry is None:
            first = np.asarray(token_ids[:8]).tolist()
            more = ", ..." if len(token_ids) > 8 else ""
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"replay: not recorded in {self._path.name}: sequence of {len(token_ids)} "
                f"tokens starting [{', '.join(map(str, first))}{more}] at top_k {top_k}, "
                f"positions [{start}, {end})",
            )
        _, offset, index = entry
        _, response = self._read(offset)
        payload = next(p for p in response.sequences if p.sequence_index == index)
        dec = decode_sequence(payload)
        n = len(dec.ids)
        sampled = (
            dec.sampled_logprobs
            if dec.sampled_logprobs is not None and len(dec.sampled_logprobs) == n
            else np.full(n, np.nan, np.float32)
        )
        return ScoredSequence(dec.ids, dec.logprobs, sampled, start)
