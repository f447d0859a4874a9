"""Request validation: every rule names the field and the limit, and maps to a gRPC status.

Pure functions over the wire message; the servicer turns :class:`RequestError` into
``context.abort`` (unary) or an ``Error`` response (stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import numpy.typing as npt

from topk_protocol import (
    DTYPE_NAMES,
    bytes_per_row,
    pb,
    request_dtype,
    request_includes_sampled,
    sequence_span,
)

__all__ = [
    "Limits",
    "ParsedRequest",
    "ParsedSequence",
    "RequestError",
    "check_token_ids",
    "check_top_k",
    "check_total_tokens",
    "parse_request",
]


class RequestError(Exception):
    """A request the server refuses: ``code`` is the gRPC status, ``message`` says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Server-side limits (all configurable from the CLI)."""

    vocab_size: int
    max_top_k: int = 64
    max_tokens_per_request: int = 262_144
    max_sequence_length: int = 0  # 0: no limit
    max_message_bytes: int = 64 * 1024 * 1024
    chunk_bytes: int = 1024 * 1024  # target size of one ScoreStream response message


@dataclass(frozen=True)
class ParsedSequence:
    """One validated sequence: ``token_ids`` ``[L]`` int32 and positions ``[start, end)``."""

    token_ids: npt.NDArray[np.int32]
    start: int
    end: int


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    sequences: list[ParsedSequence]
    top_k: int
    dtype: int
    include_sampled: bool

    @property
    def num_positions(self) -> int:
        return sum(s.end - s.start for s in self.sequences)

    def response_bytes(self) -> int:
        """Bytes of the payload arrays this request will produce."""
        return self.num_positions * bytes_per_row(self.top_k, self.dtype, self.include_sampled)


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_top_k(top_k: int, limits: Limits, field: str = "top_k") -> None:
    """K within ``[1, max_top_k]``; ``field`` names it in the error (HTTP routes name
    their own field)."""
    if not 1 <= top_k <= limits.max_top_k:
        raise _invalid(f"{field}: {top_k} is outside [1, {limits.max_top_k}] (max_top_k)")


def check_total_tokens(total: int, limits: Limits, field: str = "sequences") -> None:
    """A request's tokens in total within ``max_tokens_per_request`` (RESOURCE_EXHAUSTED)."""
    if total > limits.max_tokens_per_request:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{field}: {total} tokens in total exceeds max_tokens_per_request "
            f"{limits.max_tokens_per_request}; split the batch",
        )


def check_token_ids(ids: npt.NDArray[np.integer], limits: Limits, field: str) -> None:
    """One sequence's ids ``[L]``: at least one, at most ``max_sequence_length``, each in
    the vocabulary; ``field`` names the sequence (``field[j]`` the bad token)."""
    n = len(ids)
    if n == 0:
        raise _invalid(f"{field}: empty; a sequence needs at least 1 token")
    if limits.max_sequence_length and n > limits.max_sequence_length:
        raise _invalid(
            f"{field}: length {n} exceeds max_sequence_length {limits.max_sequence_length}"
        )
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limits.vocab_size:
        j = int(np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))[0])
        raise _invalid(
            f"{field}[{j}]: {int(ids[j])} is outside the vocabulary [0, {limits.vocab_size})"
        )


def parse_request(req: pb.ScoreRequest, limits: Limits) -> ParsedRequest:
    """Validate ``req`` against ``limits``; raise :class:`RequestError` on the first problem."""
    if not req.sequences:
        raise _invalid("sequences: empty; a request needs at least 1 sequence")
    check_top_k(req.top_k, limits)
    try:
        dtype = request_dtype(req)
    except ValueError:
        raise _invalid(
            f"dtype: unknown log-prob dtype {req.dtype}; supported: "
            + ", ".join(f"{v} ({k})" for k, v in DTYPE_NAMES.items())
        ) from None
    total = 0
    for i, seq in enumerate(req.sequences):
        n_bytes = len(seq.token_ids)
        if n_bytes % 4:
            raise _invalid(
                f"sequences[{i}].token_ids: {n_bytes} bytes is not a multiple of 4 (int32)"
            )
        total += n_bytes // 4
    check_total_tokens(total, limits)
    parsed: list[ParsedSequence] = []
    for i, seq in enumerate(req.sequences):
        ids = np.frombuffer(seq.token_ids, dtype="<i4")
        n = len(ids)
        check_token_ids(ids, limits, f"sequences[{i}].token_ids")
        start, end = sequence_span(seq)
        if not 0 <= start <= end <= n:
            raise _invalid(
                f"sequences[{i}].position_start/position_end: [{start}, {end}) is not a range "
                f"inside the sequence's {n} positions [0, {n}]"
            )
        parsed.append(ParsedSequence(ids, start, end))
    return ParsedRequest(
        req.request_id, parsed, int(req.top_k), dtype, request_includes_sampled(req)
    )
