"""What the client sends and hands back: request building, response assembly, payloads.

- :func:`build_request` turns a batch of token sequences (lists, numpy arrays, 1-D
  tensors or one 2-D tensor) into a ``ScoreRequest``.
- :class:`ResponseAssembler` collects the answer to one request (one ``Score`` message or
  the row chunks of ``ScoreStream``), checks it against the request, and decodes it into a
  padded :class:`TeacherPayload` with one vectorized copy per chunk (no per-element loop).
- :class:`TeacherInfo` is ``GetInfo`` as a dataclass.

Padding of ragged batches: rows past a sequence's end have ``ids`` 0, ``logprobs`` 0,
``sampled_logprobs`` 0 and ``mask`` False. The values are finite (nothing turns into NaN
when a masked loss multiplies them by 0), and a loss that forgets the mask fails loudly
on them (ids repeated within a position) instead of training on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from student_client.errors import InvalidRequestError, TeacherError, error_from_code
from student_client.wire import (
    DTYPE_NAMES,
    SCHEMA_VERSION,
    dtype_from_name,
    dtype_name,
    itemsize,
    pb,
)
from student_client.wire.codec import encode_token_ids

__all__ = [
    "ResponseAssembler",
    "Span",
    "TeacherInfo",
    "TeacherPayload",
    "build_request",
    "normalize_sequences",
    "request_dtype",
    "request_includes_sampled",
    "request_spans",
]

#: ``(position_start, position_end)`` of one sequence: rows ``[start, end)``.
Span = tuple[int, int]

_LE_I32 = np.dtype("<i4")
_LE_F32 = np.dtype("<f4")
_LE_F16 = np.dtype("<f2")
_LE_U16 = np.dtype("<u2")


@dataclass(frozen=True)
class TeacherInfo:
    """What the teacher announces (``GetInfo``); ``supported_dtypes`` are dtype names."""

    model_name: str
    vocab_size: int
    max_top_k: int
    tokenizer_fingerprint: str
    schema_version: int
    supported_dtypes: tuple[str, ...]
    backend: str
    max_tokens_per_request: int
    max_message_bytes: int
    max_sequence_length: int
    engine_dtype: str = ""  # what the engine computes in; empty for replay

    @classmethod
    def from_message(cls, msg: pb.TeacherInfo) -> TeacherInfo:
        known = set(DTYPE_NAMES.values())  # a newer teacher may list dtypes we do not know
        names = tuple(dtype_name(int(d)) for d in msg.supported_dtypes if int(d) in known)
        return cls(
            model_name=msg.model_name,
            vocab_size=int(msg.vocab_size),
            max_top_k=int(msg.max_top_k),
            tokenizer_fingerprint=msg.tokenizer_fingerprint,
            schema_version=int(msg.schema_version),
            supported_dtypes=names,
            backend=msg.backend,
            max_tokens_per_request=int(msg.max_tokens_per_request),
            max_message_bytes=int(msg.max_message_bytes),
            max_sequence_length=int(msg.max_sequence_length),
            engine_dtype=msg.engine_dtype,
        )

    def check_schema(self) -> None:
        """Raise :class:`TeacherError` when the teacher speaks another schema version."""
        if self.schema_version != SCHEMA_VERSION:
            raise TeacherError(
                f"schema_version: the teacher speaks {self.schema_version}, this client "
                f"speaks {SCHEMA_VERSION}"
            )


@dataclass(frozen=True)
class TeacherPayload:
    """The teacher's answer for a batch of ``B`` sequences, padded to ``S`` rows.

    Row ``j`` of sequence ``b`` is absolute position ``position_start[b] + j``: the
    teacher's distribution over the token after ``x[position_start[b] + j]`` (SPEC
    section 2), which lines up with a causal LM's ``logits[:, position_start[b] + j]``.

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

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_positions(self) -> int:
        """Real (unpadded) rows in the batch."""
        return int(self.lengths.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TeacherPayload:
        """The same payload with every tensor on ``device``."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return TeacherPayload(
            ids=move(self.ids),
            logprobs=move(self.logprobs),
            sampled_logprobs=None if self.sampled_logprobs is None else move(self.sampled_logprobs),
            mask=move(self.mask),
            position_start=move(self.position_start),
            lengths=move(self.lengths),
            top_k=self.top_k,
            dtype=self.dtype,
            request_id=self.request_id,
            teacher_seconds=self.teacher_seconds,
        )


# -- requests ------------------------------------------------------------------------------
def _as_1d_array(seq: Any, i: int) -> npt.NDArray[Any]:
    if isinstance(seq, torch.Tensor):
        arr: npt.NDArray[Any] = seq.detach().cpu().numpy()
    else:
        arr = np.asarray(seq)
    if arr.ndim != 1:
        raise InvalidRequestError(
            f"sequences[{i}]: expected a 1-D sequence of token ids, got shape {arr.shape}"
        )
    return arr


def normalize_sequences(sequences: Any) -> list[bytes]:
    """A batch of token sequences -> int32 little-endian bytes per sequence.

    ``sequences`` is a 2-D tensor / array ``[B, L]`` or a list of 1-D sequences (lists of
    ints, numpy arrays, 1-D tensors), ragged allowed. Raises :class:`InvalidRequestError`.
    """
    if isinstance(sequences, torch.Tensor | np.ndarray):
        if sequences.ndim != 2:
            raise InvalidRequestError(
                f"sequences: expected a 2-D [B, L] tensor or a list of 1-D sequences, "
                f"got shape {tuple(sequences.shape)}"
            )
        rows: Sequence[Any] = list(sequences)
    elif isinstance(sequences, str | bytes) or not isinstance(sequences, Iterable):
        raise InvalidRequestError(
            f"sequences: expected a batch of token sequences, got {type(sequences).__name__}"
        )
    else:
        rows = list(sequences)
    if not rows:
        raise InvalidRequestError("sequences: empty; a request needs at least 1 sequence")
    if isinstance(rows[0], int | np.integer):
        raise InvalidRequestError(
            "sequences: got a flat list of ints; pass a batch, e.g. [token_ids] for one sequence"
        )
    out: list[bytes] = []
    for i, seq in enumerate(rows):
        arr = _as_1d_array(seq, i)
        if arr.size == 0:
            raise InvalidRequestError(f"sequences[{i}]: empty; a sequence needs at least 1 token")
        try:
            out.append(encode_token_ids(arr))
        except ValueError as e:
            raise InvalidRequestError(f"sequences[{i}]: {e}") from None
    return out


def _check_positions(positions: Any, lengths: Sequence[int]) -> list[Span]:
    spans = list(positions)
    if len(spans) != len(lengths):
        raise InvalidRequestError(
            f"positions: {len(spans)} (start, end) pairs for {len(lengths)} sequences"
        )
    out: list[Span] = []
    for i, (pair, n) in enumerate(zip(spans, lengths, strict=True)):
        try:
            start, end = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"positions[{i}]: expected a (start, end) pair of ints, got {pair!r}"
            ) from None
        if not 0 <= start <= end <= n:
            raise InvalidRequestError(
                f"positions[{i}]: [{start}, {end}) is not a range inside the sequence's "
                f"{n} positions [0, {n}]"
            )
        out.append((start, end))
    return out


def build_request(
    sequences: Any,
    top_k: int,
    *,
    dtype: str | int = "float16",
    positions: Sequence[tuple[int, int]] | None = None,
    include_sampled: bool = True,
    request_id: str = "",
) -> pb.ScoreRequest:
    """Build a ``ScoreRequest`` for a batch (see :func:`normalize_sequences`).

    ``positions``: ``None`` (every position) or one ``(start, end)`` per sequence.
    Client-side checks raise :class:`InvalidRequestError` naming the field; the server
    checks the rest (vocabulary, limits).
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1:
        raise InvalidRequestError(f"top_k: expected an int >= 1, got {top_k!r}")
    try:
        enum = dtype_from_name(dtype)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    token_bytes = normalize_sequences(sequences)
    req = pb.ScoreRequest(request_id=request_id, top_k=int(top_k), dtype=enum)  # type: ignore[arg-type]
    if not include_sampled:
        req.include_sampled_logprobs = False
    spans = (
        _check_positions(positions, [len(b) // 4 for b in token_bytes])
        if positions is not None
        else None
    )
    for i, buf in enumerate(token_bytes):
        seq = req.sequences.add(token_ids=buf)
        if spans is not None:
            seq.position_start, seq.position_end = spans[i]
    return req


def request_spans(req: pb.ScoreRequest) -> list[Span]:
    """``[start, end)`` of every sequence of a request (unset start 0, unset end L)."""
    out: list[Span] = []
    for seq in req.sequences:
        n = len(seq.token_ids) // 4
        start = seq.position_start if seq.HasField("position_start") else 0
        end = seq.position_end if seq.HasField("position_end") else n
        out.append((int(start), int(end)))
    return out


def request_dtype(req: pb.ScoreRequest) -> int:
    """The request's wire dtype enum (UNSPECIFIED -> FLOAT16)."""
    return dtype_from_name(int(req.dtype))


def request_includes_sampled(req: pb.ScoreRequest) -> bool:
    return bool(req.include_sampled_logprobs) if req.HasField("include_sampled_logprobs") else True


# -- responses -----------------------------------------------------------------------------
def _protocol(message: str) -> TeacherError:
    return TeacherError(f"teacher answer does not match the request: {message}")


def _put_floats(dst: npt.NDArray[np.float32], buf: bytes, dtype: int) -> None:
    """Decode ``buf`` (wire ``dtype``) into the float32 view ``dst`` in one vectorized copy."""
    if dtype == pb.LOGPROB_DTYPE_FLOAT32:
        dst[...] = np.frombuffer(buf, dtype=_LE_F32).reshape(dst.shape)
    elif dtype == pb.LOGPROB_DTYPE_FLOAT16:
        dst[...] = np.frombuffer(buf, dtype=_LE_F16).reshape(dst.shape)
    else:  # bfloat16: the upper 16 bits of a float32, written straight into the halves
        halves = dst.view(_LE_U16).reshape(*dst.shape, 2)
        halves[..., 0] = 0
        halves[..., 1] = np.frombuffer(buf, dtype=_LE_U16).reshape(dst.shape)


class ResponseAssembler:
    """Collects the answer to one request and decodes it.

    Feed every ``ScoreResponse`` of the request to :meth:`add` (one unary answer, or the
    stream's row chunks in arrival order). Once :attr:`complete`, :meth:`payload` builds
    the tensors and :meth:`merged_response` the equivalent single message (chunks joined),
    which is what recordings store. An ``error`` answer sets :attr:`error` instead.
    """

    def __init__(self, request: pb.ScoreRequest) -> None:
        self.request = request
        self.spans = request_spans(request)
        self.top_k = int(request.top_k)
        self.dtype = request_dtype(request)
        self.include_sampled = request_includes_sampled(request)
        self.complete = False
        self.error: TeacherError | None = None
        self.teacher_seconds = 0.0
        self._chunks: list[list[pb.SequencePayload]] = [[] for _ in self.spans]
        self._rows = [0] * len(self.spans)
        self._size = itemsize(self.dtype)

    def reset(self) -> None:
        """Forget partial chunks (the request is being sent again)."""
        self._chunks = [[] for _ in self.spans]
        self._rows = [0] * len(self.spans)
        self.complete = False
        self.error = None

    def add(self, msg: pb.ScoreResponse) -> None:
        """Take one response message of this request. Raises :class:`TeacherError` when it
        contradicts the request (wrong K, dtype, positions, byte lengths)."""
        if msg.HasField("error"):
            self.error = error_from_code(msg.error.code, msg.error.message)
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
                _put_floats(lps[i, rows], c.logprobs, self.dtype)
                if sampled is not None:
                    _put_floats(sampled[i, rows], c.sampled_logprobs, self.dtype)
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

    def response_bytes(self) -> int:
        """Payload bytes this request's answer carries (ids + log-probs + sampled)."""
        per_row = self.top_k * (4 + self._size) + (self._size if self.include_sampled else 0)
        return per_row * sum(end - start for start, end in self.spans)
