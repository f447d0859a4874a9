"""``ReplayClient``: the client interface, answered from a recording instead of a teacher.

The same requests give the recorded payloads bit-exactly (the recorded bytes are
decoded by the same code). A request that is not in the recording raises
:class:`~student_client.errors.NotRecordedError` saying which one; lookups go through the
recording's index (random access, no scan).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from student_client._closeable import Closeable
from student_client.client import ScoreBatch
from student_client.errors import InvalidRequestError, NotRecordedError, VocabMismatchError
from student_client.payload import (
    ResponseAssembler,
    TeacherInfo,
    TeacherPayload,
    build_request,
    request_dtype,
    request_includes_sampled,
    request_spans,
)
from student_client.recording import RecordingReader, request_key
from student_client.wire import dtype_name, pb

__all__ = ["ReplayClient", "describe_request"]


def describe_request(request: pb.ScoreRequest, max_tokens: int = 8) -> str:
    """A short human description of a request: sizes, first tokens, K, dtype, positions."""
    lengths = [len(s.token_ids) // 4 for s in request.sequences]
    first = (
        np.frombuffer(request.sequences[0].token_ids, dtype="<i4")[:max_tokens].tolist()
        if request.sequences
        else []
    )
    more = ", ..." if lengths and lengths[0] > max_tokens else ""
    return (
        f"{len(lengths)} sequences (lengths {lengths}; sequences[0] starts "
        f"[{', '.join(map(str, first))}{more}]), top_k {request.top_k}, "
        f"dtype {dtype_name(request_dtype(request))}, "
        f"include_sampled {request_includes_sampled(request)}, "
        f"positions {request_spans(request)}"
    )


class ReplayClient(Closeable):
    """Serves ``info``/``score``/``stream`` from a recording file.

    Args:
        path: the recording (see :mod:`student_client.recording`).
        expect_vocab_size, expect_tokenizer_fingerprint: checked against the recorded
            teacher's info at open; a mismatch raises VocabMismatchError.
        strict: see :class:`~student_client.recording.RecordingReader`.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        expect_vocab_size: int | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        strict: bool = True,
    ) -> None:
        self._reader = RecordingReader(path, strict=strict)
        self._info = TeacherInfo.from_message(self._reader.info)
        try:
            self._info.check_schema()
            problems = []
            if expect_vocab_size is not None and expect_vocab_size != self._info.vocab_size:
                problems.append(
                    f"vocab_size: the teacher has {self._info.vocab_size}, "
                    f"the student expects {expect_vocab_size}"
                )
            fp = self._info.tokenizer_fingerprint
            if expect_tokenizer_fingerprint is not None and expect_tokenizer_fingerprint != fp:
                problems.append(
                    f"tokenizer_fingerprint: the teacher has {fp!r}, "
                    f"the student expects {expect_tokenizer_fingerprint!r}"
                )
            if problems:
                raise VocabMismatchError(f"recording {path}: " + "; ".join(problems))
        except BaseException:
            self._reader.close()
            raise

    @property
    def path(self) -> Path:
        return self._reader.path

    def __len__(self) -> int:
        """Requests in the recording."""
        return len(self._reader)

    def info(self) -> TeacherInfo:
        """The recorded teacher's ``GetInfo``."""
        return self._info

    def _check(self, request: pb.ScoreRequest) -> None:
        """The checks of the live teacher that do not need the engine."""
        info = self._info
        if info.max_top_k and not 1 <= request.top_k <= info.max_top_k:
            raise InvalidRequestError(
                f"top_k: {request.top_k} is outside [1, {info.max_top_k}] (max_top_k)"
            )
        for i, seq in enumerate(request.sequences):
            ids = np.frombuffer(seq.token_ids, dtype="<i4")
            bad = (ids < 0) | (ids >= info.vocab_size)
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                raise InvalidRequestError(
                    f"sequences[{i}].token_ids[{j}]: {int(ids[j])} is outside the vocabulary "
                    f"[0, {info.vocab_size})"
                )

    def _answer(self, request: pb.ScoreRequest, device: torch.device | str) -> TeacherPayload:
        self._check(request)
        found = self._reader.get(request_key(request))
        if found is None:
            raise NotRecordedError(
                f"recording {self.path}: request not recorded: {describe_request(request)}; "
                f"the recording holds {len(self._reader)} requests"
            )
        asm = ResponseAssembler(request)
        asm.add(found[1])
        return asm.payload(device)

    def score(
        self,
        sequences: Any,
        top_k: int,
        *,
        dtype: str = "float16",
        positions: Sequence[tuple[int, int]] | None = None,
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
    ) -> TeacherPayload:
        """The recorded payload of this batch (arguments as ``TeacherClient.score``)."""
        request = build_request(
            sequences, top_k, dtype=dtype, positions=positions, include_sampled=include_sampled
        )
        return self._answer(request, device)

    def stream(
        self,
        batches: Iterable[Any],
        top_k: int,
        *,
        depth: int = 4,
        dtype: str = "float16",
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
    ) -> Iterator[TeacherPayload]:
        """The recorded payloads of ``batches``, in order, read lazily (``depth`` is
        accepted for interface parity; there is nothing to prefetch)."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
        for batch in batches:
            if isinstance(batch, ScoreBatch):
                sequences, positions = batch.sequences, batch.positions
            else:
                sequences, positions = batch, None
            yield self.score(
                sequences,
                top_k,
                dtype=dtype,
                positions=positions,
                include_sampled=include_sampled,
                device=device,
            )

    def close(self) -> None:
        self._reader.close()
