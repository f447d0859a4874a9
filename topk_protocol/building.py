"""The request message: sequences normalised to wire bytes, positions and candidate ids
checked, a ``ScoreRequest`` built from them and a :class:`~topk_protocol.requests.RequestOptions`,
and read back (each sequence's span, the size of the answer it asks for)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.checks import (
    check_candidates_unsampled,
    check_range,
    check_sequence_count,
    check_sequence_length,
)
from topk_protocol.codec import (
    encode_token_ids,
)
from topk_protocol.errors import InvalidRequestError
from topk_protocol.requests import (
    RequestOptions,
    Span,
)

__all__ = [
    "build_request",
    "check_span",
    "encode_candidates",
    "normalize_sequences",
    "request_spans",
    "response_bytes",
    "sequence_span",
]


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
    rows = _batch_items(sequences, "sequences", 2, "a 2-D [B, L] tensor or a list of 1-D sequences")
    check_sequence_count(len(rows))
    if isinstance(rows[0], int | np.integer):
        raise InvalidRequestError(
            "sequences: got a flat list of ints; pass a batch, e.g. [token_ids] for one sequence"
        )
    out: list[bytes] = []
    for i, seq in enumerate(rows):
        arr = _as_1d_array(seq, i)
        check_sequence_length(arr.size, f"sequences[{i}]")
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
    check_range(start, end, limit, f"positions[{index}]", inside)
    return start, end


def _batch_items(value: Any, field: str, ndim: int, expected: str) -> list[Any]:
    """A batch's items: the rows of an ``ndim``-D tensor / array, or the items of an
    iterable (not a string). :class:`InvalidRequestError` naming ``field`` otherwise."""
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim != ndim:
            raise InvalidRequestError(
                f"{field}: expected {expected}, got shape {tuple(value.shape)}"
            )
        return list(value)
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{field}: expected {expected}, got {type(value).__name__}")
    return list(value)


def _candidate_rows(candidate_ids: Any, count: int) -> list[Any]:
    """``[B, S', C]`` tensor / array, or ``B`` items (``[S'_i, C]`` or None) -> a list."""
    rows = _batch_items(candidate_ids, "candidate_ids", 3, "[B, S, C] or one [S, C] per sequence")
    if len(rows) != count:
        raise InvalidRequestError(f"candidate_ids: {len(rows)} rows for {count} sequences")
    return rows


def encode_candidates(candidates: Any, rows: int, field: str) -> tuple[bytes, int]:
    """One sequence's candidate ids for its ``rows`` requested positions -> ``(int32
    little-endian bytes of [rows, C], C)``. ``candidates`` is ``[S', C]`` with ``S' >=
    rows`` (the rows after ``rows`` are padding, dropped), ints in ``[-1, 2**31)``;
    ``-1`` pads a row with fewer ids. None or ``C = 0``: no candidates (``(b"", 0)``).
    Raises :class:`InvalidRequestError` naming ``field``; the teacher checks the
    vocabulary and its ``max_candidates``."""
    if candidates is None:
        return b"", 0
    arr = (
        candidates.detach().cpu().numpy()
        if isinstance(candidates, torch.Tensor)
        else np.asarray(candidates)
    )
    if arr.ndim != 2:
        raise InvalidRequestError(f"{field}: expected [S, C], got shape {arr.shape}")
    if arr.shape[1] == 0:
        return b"", 0
    if arr.shape[0] < rows:
        raise InvalidRequestError(
            f"{field}: {arr.shape[0]} rows for the {rows} requested positions"
        )
    arr = arr[:rows]
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"{field}: expected integer ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < -1 or int(arr.max()) > np.iinfo(np.int32).max):
        raise InvalidRequestError(f"{field}: ids must lie in [-1, 2**31) (-1 pads a row)")
    return np.ascontiguousarray(arr, dtype="<i4").tobytes(), int(arr.shape[1])


def build_request(
    sequences: Any,
    top_k: int | RequestOptions,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
    request_id: str = "",
    candidate_ids: Any = None,
    **options: Any,
) -> pb.ScoreRequest:
    """Build a ``ScoreRequest`` for a batch (see :func:`normalize_sequences`).

    ``top_k`` is K or a whole :class:`RequestOptions`; ``options`` are its other fields
    by keyword (``dtype``, ``include_sampled``; see :meth:`RequestOptions.of`).
    ``positions``: ``None`` (every position) or one ``(start, end)`` per sequence.
    ``candidate_ids``: None, or ids to score at every requested position: ``[B, S, C]``
    (a tensor or array) or one ``[S_i, C]`` (or None) per sequence, row ``j`` of
    sequence ``b`` for position ``positions[b][0] + j`` (rows past a sequence's
    requested positions are padding; ``-1`` pads a row; see :func:`encode_candidates`).
    Client-side checks raise :class:`InvalidRequestError` naming the field; the server
    checks the rest (vocabulary, limits).
    """
    opts = RequestOptions.of(top_k, **options)
    token_bytes = normalize_sequences(sequences)
    req = opts.to_proto(pb.ScoreRequest(request_id=request_id))
    spans = (
        _check_positions(positions, [len(b) // 4 for b in token_bytes])
        if positions is not None
        else None
    )
    cands = None if candidate_ids is None else _candidate_rows(candidate_ids, len(token_bytes))
    for i, buf in enumerate(token_bytes):
        seq = req.sequences.add(token_ids=buf)
        if spans is not None:
            seq.position_start, seq.position_end = spans[i]
        if cands is not None:
            start, end = sequence_span(seq)
            raw, c = encode_candidates(cands[i], end - start, f"candidate_ids[{i}]")
            if c:
                check_candidates_unsampled(opts.samples, f"candidate_ids[{i}]")
                seq.candidate_ids, seq.num_candidates = raw, c
    return req


# -- spans --------------------------------------------------------------------------------
def sequence_span(seq: pb.SequenceRequest) -> Span:
    """``[start, end)`` of one requested sequence: unset start is 0, unset end is its length."""
    n = len(seq.token_ids) // 4
    start = seq.position_start if seq.HasField("position_start") else 0
    end = seq.position_end if seq.HasField("position_end") else n
    return int(start), int(end)


def request_spans(req: pb.ScoreRequest) -> list[Span]:
    """``[start, end)`` of every sequence of a request (see :func:`sequence_span`)."""
    return [sequence_span(seq) for seq in req.sequences]


def response_bytes(
    req: pb.ScoreRequest, vocab_size: int = 0, options: RequestOptions | None = None
) -> int:
    """Bytes of the payload arrays the answer to ``req`` carries (a packed answer's from
    a teacher of ``vocab_size`` tokens; 0: unknown, an upper bound); ``options``: the ones
    ``req`` was built with (None: read back from it)."""
    opts = RequestOptions.from_proto(req) if options is None else options
    return sum(
        (end - start) * opts.bytes_per_row(vocab_size, int(seq.num_candidates))
        for seq, (start, end) in zip(req.sequences, request_spans(req), strict=True)
    )
