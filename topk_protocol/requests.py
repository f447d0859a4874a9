"""Requests: building and normalizing a ``ScoreRequest``, its defaults, and its sizes.

Both sides read a request through these functions, so a default (dtype, positions,
include-sampled) or a size rule (bytes per row, the one-message rule) is written once:
the client builds requests and decides between ``Score`` and ``ScoreStream`` with them,
the server validates requests and sizes its answers with them, recordings key on them.
Rules in ``docs/protocol.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.codec import dtype_from_name, encode_token_ids, itemsize
from topk_protocol.errors import InvalidRequestError

__all__ = [
    "DEFAULT_DTYPE",
    "FRAMING_BYTES",
    "Span",
    "build_request",
    "bytes_per_row",
    "check_span",
    "fits_one_message",
    "normalize_sequences",
    "request_dtype",
    "request_includes_sampled",
    "request_spans",
    "response_bytes",
    "sequence_span",
]

#: ``(position_start, position_end)`` of one sequence: rows ``[start, end)``.
Span = tuple[int, int]

#: Wire dtype of the log-probs when a request leaves it unset.
DEFAULT_DTYPE = pb.LOGPROB_DTYPE_FLOAT16

#: Room left for protobuf framing, per payload and per message, when deciding whether an
#: answer fits in one message (the arrays dominate; tags and varints take a few bytes).
FRAMING_BYTES = 64


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
    return [
        check_span(pair, i, n, f"the sequence's {n} positions")
        for i, (pair, n) in enumerate(zip(spans, lengths, strict=True))
    ]


def check_span(pair: Any, index: int, limit: int, inside: str) -> Span:
    """``positions[index]`` as a ``(start, end)`` pair of ints, ``0 <= start <= end <=
    limit``; ``inside`` names what the range must lie in (for the error message)."""
    try:
        start, end = (int(v) for v in pair)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"positions[{index}]: expected a (start, end) pair of ints, got {pair!r}"
        ) from None
    if not 0 <= start <= end <= limit:
        raise InvalidRequestError(
            f"positions[{index}]: [{start}, {end}) is not a range inside {inside} [0, {limit}]"
        )
    return start, end


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


def sequence_span(seq: pb.SequenceRequest) -> Span:
    """``[start, end)`` of one requested sequence: unset start is 0, unset end is its length."""
    n = len(seq.token_ids) // 4
    start = seq.position_start if seq.HasField("position_start") else 0
    end = seq.position_end if seq.HasField("position_end") else n
    return int(start), int(end)


def request_spans(req: pb.ScoreRequest) -> list[Span]:
    """``[start, end)`` of every sequence of a request (see :func:`sequence_span`)."""
    return [sequence_span(seq) for seq in req.sequences]


def request_dtype(req: pb.ScoreRequest) -> int:
    """The request's wire dtype enum (LOGPROB_DTYPE_DEFAULT -> :data:`DEFAULT_DTYPE`); raises
    ``ValueError`` naming ``dtype`` for a value this schema does not know."""
    return dtype_from_name(int(req.dtype))


def request_includes_sampled(req: pb.ScoreRequest) -> bool:
    """Whether the answer carries the sampled log-probs (unset: yes)."""
    return bool(req.include_sampled_logprobs) if req.HasField("include_sampled_logprobs") else True


# -- sizes ---------------------------------------------------------------------------------
def bytes_per_row(top_k: int, dtype: int, include_sampled: bool) -> int:
    """Payload bytes of one position: K ids (int32) + K log-probs (+ the sampled log-prob)."""
    size = itemsize(dtype)
    return top_k * (4 + size) + (size if include_sampled else 0)


def response_bytes(req: pb.ScoreRequest) -> int:
    """Bytes of the payload arrays the answer to ``req`` carries."""
    per_row = bytes_per_row(int(req.top_k), request_dtype(req), request_includes_sampled(req))
    return per_row * sum(end - start for start, end in request_spans(req))


def fits_one_message(payload_bytes: int, num_sequences: int, max_message_bytes: int) -> bool:
    """The one-message rule: a unary ``Score`` answer of ``payload_bytes`` array bytes over
    ``num_sequences`` sequences fits in ``max_message_bytes`` once framing is counted."""
    return payload_bytes + FRAMING_BYTES * (num_sequences + 1) <= max_message_bytes
