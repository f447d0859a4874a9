"""Request validation: every rule names the field and the limit.

Pure functions over the wire message. A refused request raises one of the protocol's
typed errors (:class:`~topk_protocol.errors.InvalidRequestError`,
:class:`~topk_protocol.errors.ResourceExhaustedError`); the servicer alone turns them
into gRPC status codes (:func:`topk_protocol.status.status_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from teacher_server.config import MIB, ServerConfig
from topk_protocol import RequestOptions, pb, sequence_span
from topk_protocol.errors import InvalidRequestError, ResourceExhaustedError
from topk_protocol.requests import check_token_ids as check_vocabulary
from topk_protocol.requests import check_top_k as check_k

__all__ = [
    "Limits",
    "ParsedRequest",
    "ParsedSequence",
    "check_token_ids",
    "check_top_k",
    "check_total_tokens",
    "parse_request",
]


@dataclass(frozen=True)
class Limits:
    """Server-side limits: the :class:`ServerConfig` ones (defaults included) and what the
    loaded engine says (vocabulary size, longest sequence; 0: no limit)."""

    vocab_size: int
    max_top_k: int = ServerConfig.max_top_k
    max_tokens_per_request: int = ServerConfig.max_tokens_per_request
    max_sequence_length: int = 0
    max_message_bytes: int = ServerConfig.max_message_mb * MIB
    chunk_bytes: int = ServerConfig.chunk_kb * 1024  # target size of one ScoreStream message

    @classmethod
    def from_config(cls, config: ServerConfig, vocab_size: int = 0) -> Limits:
        """The limits ``config`` sets (``vocab_size`` 0: not known before the engine)."""
        return cls(
            vocab_size=vocab_size,
            max_top_k=config.max_top_k,
            max_tokens_per_request=config.max_tokens_per_request,
            max_message_bytes=config.max_message_bytes,
            chunk_bytes=config.chunk_bytes,
        )


@dataclass(frozen=True)
class ParsedSequence:
    """One validated sequence: ``token_ids`` ``[L]`` int32 and positions ``[start, end)``."""

    token_ids: npt.NDArray[np.int32]
    start: int
    end: int


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its sequences and the options every backend is handed."""

    request_id: str
    sequences: list[ParsedSequence]
    options: RequestOptions

    @property
    def num_positions(self) -> int:
        return sum(s.end - s.start for s in self.sequences)

    def response_bytes(self) -> int:
        """Bytes of the payload arrays this request will produce."""
        return self.num_positions * self.options.bytes_per_row()


def check_top_k(top_k: int, limits: Limits, field: str = "top_k") -> None:
    """K within ``[1, max_top_k]``; ``field`` names it in the error (HTTP routes name
    their own field)."""
    check_k(int(top_k), limits.max_top_k, field)


def check_total_tokens(total: int, limits: Limits, field: str = "sequences") -> None:
    """A request's tokens in total within ``max_tokens_per_request``."""
    if total > limits.max_tokens_per_request:
        raise ResourceExhaustedError(
            f"{field}: {total} tokens in total exceeds max_tokens_per_request "
            f"{limits.max_tokens_per_request}; split the batch"
        )


def check_token_ids(ids: npt.NDArray[np.integer], limits: Limits, field: str) -> None:
    """One sequence's ids ``[L]``: at least one, at most ``max_sequence_length``, each in
    the vocabulary; ``field`` names the sequence (``field[j]`` the bad token)."""
    n = len(ids)
    if n == 0:
        raise InvalidRequestError(f"{field}: empty; a sequence needs at least 1 token")
    if limits.max_sequence_length and n > limits.max_sequence_length:
        raise InvalidRequestError(
            f"{field}: length {n} exceeds max_sequence_length {limits.max_sequence_length}"
        )
    check_vocabulary(ids, limits.vocab_size, field)


def parse_request(req: pb.ScoreRequest, limits: Limits) -> ParsedRequest:
    """Validate ``req`` against ``limits``; raise the typed error of the first problem."""
    if not req.sequences:
        raise InvalidRequestError("sequences: empty; a request needs at least 1 sequence")
    check_top_k(req.top_k, limits)
    options = RequestOptions.from_proto(req)
    total = 0
    for i, seq in enumerate(req.sequences):
        n_bytes = len(seq.token_ids)
        if n_bytes % 4:
            raise InvalidRequestError(
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
            raise InvalidRequestError(
                f"sequences[{i}].position_start/position_end: [{start}, {end}) is not a range "
                f"inside the sequence's {n} positions [0, {n}]"
            )
        parsed.append(ParsedSequence(ids, start, end))
    return ParsedRequest(req.request_id, parsed, options)
