"""What the client hands back: the answer to one request, checked and decoded.

:class:`ResponseAssembler` collects the answer to one request (one ``Score`` message or
the row chunks of ``ScoreStream``), checks it against the request, and decodes it into a
padded :class:`TeacherPayload` with one vectorized copy per chunk (no per-element loop).
Requests are built by :func:`topk_protocol.build_request` (through
:func:`student_client.alignment.build_aligned_request`).

Padding of ragged batches: rows past a sequence's end have ``ids`` 0, ``logprobs`` 0,
``sampled_logprobs`` 0 and ``mask`` False. The values are finite (nothing turns into NaN
when a masked loss multiplies them by 0), and a loss that forgets the mask fails loudly
on them (ids repeated within a position) instead of training on them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from topk_protocol import (
    RequestOptions,
    decode_floats_into,
    dtype_from_name,
    dtype_name,
    itemsize,
    pb,
    request_spans,
)
from topk_protocol.errors import TeacherError
from topk_protocol.status import error_from_code

if TYPE_CHECKING:
    from student_client.alignment import PaddedLayout

__all__ = ["ResponseAssembler", "TeacherPayload"]

_LE_I32 = np.dtype("<i4")


@dataclass(frozen=True)
class TeacherPayload:
    """The teacher's answer for a batch of ``B`` sequences, padded to ``S`` rows.

    Row ``j`` of sequence ``b`` is absolute position ``position_start[b] + j``: the
    teacher's distribution over the token after ``x[position_start[b] + j]``
    (``docs/protocol.md``, position alignment), which lines up with a causal LM's
    ``logits[:, position_start[b] + j]``.

    Attributes:
        ids: ``[B, S, K]`` int64 token ids, each row sorted by log-prob, descending.
        logprobs: ``[B, S, K]`` float32 log-probs (the wire dtype widened exactly).
        sampled_logprobs: ``[B, S]`` float32 log-prob of the token that actually follows
            (NaN at a sequence's last position), or ``None`` when not requested.
        mask: ``[B, S]`` bool, True on real rows, False on padding (padding rows hold
            ids 0, log-probs 0, sampled log-probs 0).
        position_start: ``[B]`` int64 absolute position of row 0 of each sequence.
        lengths: ``[B]`` int64 number of real rows of each sequence.
        top_k: K.
        dtype: wire dtype of the log-probs (``"float16"``, ``"bfloat16"``, ``"float32"``).
        request_id: the request's id.
        teacher_seconds: engine time the teacher reported for the request.
        teachers: the name of the teacher that scored each sequence (``B`` names), from
            a multi-teacher client or recording; None from a single teacher.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor | None
    mask: torch.Tensor
    position_start: torch.Tensor
    lengths: torch.Tensor
    top_k: int
    dtype: str
    request_id: str = ""
    teacher_seconds: float = 0.0
    teachers: tuple[str, ...] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_positions(self) -> int:
        """Real (unpadded) rows in the batch."""
        return int(self.lengths.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TeacherPayload:
        """The same payload with every tensor on ``device``."""
        moved: dict[str, Any] = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


# -- responses -----------------------------------------------------------------------------
def _protocol(message: str) -> TeacherError:
    return TeacherError(f"teacher answer does not match the request: {message}")


class ResponseAssembler:
    """Collects the answer to one request and decodes it.

    Feed every ``ScoreResponse`` of the request to :meth:`add` (one unary answer, or the
    stream's row chunks in arrival order). Once :attr:`complete`, :meth:`payload` builds
    the tensors and :meth:`merged_response` the equivalent single message (chunks joined),
    which is what recordings store. An ``error`` answer sets :attr:`error` instead.
    ``layout`` is where the batch's rows sit when it came padded (see
    :func:`student_client.alignment.align`), kept with the answer it belongs to.
    """

    def __init__(self, request: pb.ScoreRequest, layout: PaddedLayout | None = None) -> None:
        self.request = request
        self.layout = layout
        self.spans = request_spans(request)
        options = RequestOptions.from_proto(request)
        self.top_k = options.top_k
        self.dtype = options.wire_dtype
        self.include_sampled = options.include_sampled
        self.teacher_seconds = 0.0
        self._size = itemsize(self.dtype)
        self.reset()

    def reset(self) -> None:
        """Forget partial chunks (the request is being sent again)."""
        self._chunks: list[list[pb.SequencePayload]] = [[] for _ in self.spans]
        self._rows = [0] * len(self.spans)
        self.complete = False
        self.error: TeacherError | None = None

    def add(self, msg: pb.ScoreResponse) -> None:
        """Take one response message of this request. Raises :class:`TeacherError` when it
        contradicts the request (wrong K, dtype, positions, byte lengths)."""
        if msg.HasField("error"):
            self.error = error_from_code(msg.error.code, msg.error.message, msg.error.reason)
            self.complete = True
            return
        for chunk in msg.sequences:
            self._add_chunk(chunk)
        if msg.final:
            self.teacher_seconds = float(msg.teacher_seconds)
            for i, ((start, end), rows) in enumerate(zip(self.spans, self._rows, strict=True)):
                if rows != end - start:
                    raise _protocol(
                        f"sequences[{i}]: got {rows} rows, expected {end - start} "
                        f"(positions [{start}, {end}))"
                    )
            self.complete = True

    def _add_chunk(self, c: pb.SequencePayload) -> None:
        i = int(c.sequence_index)
        if i >= len(self.spans):
            raise _protocol(f"sequence_index {i} is outside the request's {len(self.spans)}")
        n, k = int(c.num_positions), self.top_k
        where = f"sequences[{i}]"
        if n and int(c.top_k) != k:
            raise _protocol(f"{where}: top_k {c.top_k}, requested {k}")
        if n and dtype_from_name(int(c.dtype)) != self.dtype:
            raise _protocol(f"{where}: dtype {c.dtype}, requested {self.dtype}")
        expected_start = self.spans[i][0] + self._rows[i]
        if int(c.position_start) != expected_start and n:
            raise _protocol(
                f"{where}: chunk starts at position {c.position_start}, expected {expected_start}"
            )
        if self._rows[i] + n > self.spans[i][1] - self.spans[i][0]:
            raise _protocol(f"{where}: more rows than the positions requested")
        if len(c.ids) != n * k * 4 or len(c.logprobs) != n * k * self._size:
            raise _protocol(
                f"{where}: ids/logprobs byte lengths {len(c.ids)}/{len(c.logprobs)} do not "
                f"fit [{n}, {k}]"
            )
        want_sampled = n * self._size if self.include_sampled else 0
        if len(c.sampled_logprobs) != want_sampled:
            raise _protocol(
                f"{where}: sampled_logprobs has {len(c.sampled_logprobs)} bytes, "
                f"expected {want_sampled}"
            )
        self._chunks[i].append(c)
        self._rows[i] += n

    def merged_response(self) -> pb.ScoreResponse:
        """The complete answer as one message: one ``SequencePayload`` per sequence."""
        if not self.complete or self.error is not None:
            raise TeacherError("merged_response: the request is not answered (or failed)")
        out = pb.ScoreResponse(
            request_id=self.request.request_id,
            final=True,
            teacher_seconds=self.teacher_seconds,
        )
        for i, chunks in enumerate(self._chunks):
            out.sequences.append(
                pb.SequencePayload(
                    sequence_index=i,
                    position_start=self.spans[i][0],
                    num_positions=self._rows[i],
                    top_k=self.top_k,
                    dtype=self.dtype,  # type: ignore[arg-type]
                    ids=b"".join(c.ids for c in chunks),
                    logprobs=b"".join(c.logprobs for c in chunks),
                    sampled_logprobs=b"".join(c.sampled_logprobs for c in chunks),
                )
            )
        return out

    def payload(self, device: torch.device | str = "cpu") -> TeacherPayload:
        """Decode into padded ``[B, S, K]`` tensors on ``device`` (raises :attr:`error`)."""
        if self.error is not None:
            raise self.error
        if not self.complete:
            raise TeacherError("payload: the request is not answered yet")
        b, k = len(self.spans), self.top_k
        s = max(self._rows, default=0)
        ids = np.zeros((b, s, k), dtype=np.int64)
        lps = np.zeros((b, s, k), dtype=np.float32)
        sampled = np.zeros((b, s), dtype=np.float32) if self.include_sampled else None
        mask = np.zeros((b, s), dtype=np.bool_)
        for i, chunks in enumerate(self._chunks):  # one loop over sequences and chunks
            row = 0
            for c in chunks:
                n = int(c.num_positions)
                if n == 0:
                    continue
                rows = slice(row, row + n)
                ids[i, rows] = np.frombuffer(c.ids, dtype=_LE_I32).reshape(n, k)
                decode_floats_into(lps[i, rows], c.logprobs, self.dtype, "logprobs")
                if sampled is not None:
                    decode_floats_into(
                        sampled[i, rows], c.sampled_logprobs, self.dtype, "sampled_logprobs"
                    )
                row += n
            mask[i, :row] = True
        starts = torch.tensor([sp[0] for sp in self.spans], dtype=torch.int64)
        payload = TeacherPayload(
            ids=torch.from_numpy(ids),
            logprobs=torch.from_numpy(lps),
            sampled_logprobs=None if sampled is None else torch.from_numpy(sampled),
            mask=torch.from_numpy(mask),
            position_start=starts,
            lengths=torch.tensor(self._rows, dtype=torch.int64),
            top_k=k,
            dtype=dtype_name(self.dtype),
            request_id=self.request.request_id,
            teacher_seconds=self.teacher_seconds,
        )
        return payload if str(device) == "cpu" else payload.to(device)
