"""Request validation: a ``ScoreRequest`` against the server's limits, every rule naming
the field and the limit.

The rules themselves are the protocol's (:mod:`topk_protocol.checks`), applied with the
server's :class:`Limits`. A refused request raises one of the protocol's typed errors
(:class:`~topk_protocol.errors.InvalidRequestError`,
:class:`~topk_protocol.errors.ResourceExhaustedError`); the request pipeline alone turns
them into statuses (:mod:`teacher_server.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from teacher_server.config import MIB, ServerConfig
from topk_protocol import RequestOptions, pb, sequence_span
from topk_protocol.checks import (
    TeacherLimits,
    check_candidates,
    check_range,
    check_samples,
    check_sequence_count,
    check_token_ids,
    check_top_k,
    check_total_tokens,
)
from topk_protocol.errors import InvalidRequestError
from topk_protocol.packing import Packing

__all__ = ["Limits", "ParsedRequest", "ParsedSequence", "Undecodable", "parse_request"]


class Undecodable:
    """A request whose bytes are not a valid message of the method's request type (the
    gRPC front end's deserializers return one instead of raising:
    :mod:`teacher_server.grpc_api.handlers`); the request pipeline refuses it with
    INVALID_ARGUMENT."""

    def __init__(self, type_name: str, size: int, error: Exception) -> None:
        self.message = f"request: {size} bytes are not a valid {type_name} ({error})"


@dataclass(frozen=True)
class Limits(TeacherLimits):
    """Server-side limits: the :class:`ServerConfig` ones (defaults included), what the
    loaded engine says (vocabulary size, longest sequence; 0: no limit), and the sizes of
    its answers (gRPC message limit, ScoreStream chunk)."""

    max_top_k: int = ServerConfig.max_top_k
    max_tokens_per_request: int = ServerConfig.max_tokens_per_request
    max_sequence_length: int = 0
    max_candidates: int = ServerConfig.max_candidates
    max_message_bytes: int = ServerConfig.max_message_mb * MIB
    chunk_bytes: int = ServerConfig.chunk_kb * 1024  # target size of one ScoreStream message

    @classmethod
    def from_config(cls, config: ServerConfig, vocab_size: int = 0) -> Limits:
        """The limits ``config`` sets (``vocab_size`` 0: not known before the engine)."""
        return cls(
            vocab_size=vocab_size,
            max_top_k=config.max_top_k,
            max_tokens_per_request=config.max_tokens_per_request,
            max_candidates=config.max_candidates,
            max_message_bytes=config.max_message_bytes,
            chunk_bytes=config.chunk_bytes,
        )


@dataclass(frozen=True)
class ParsedSequence:
    """One validated sequence: ``token_ids`` ``[L]`` int32, positions ``[start, end)``
    and, when the request names them, ``candidate_ids`` ``[end - start, C]`` int32 (ids
    in ``[-1, vocab_size)``, ``-1`` padding) to score at each position."""

    token_ids: npt.NDArray[np.int32]
    start: int
    end: int
    candidate_ids: npt.NDArray[np.int32] | None = None

    @property
    def num_candidates(self) -> int:
        """``C`` (0 without candidates)."""
        return 0 if self.candidate_ids is None else int(self.candidate_ids.shape[1])


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its sequences and the options every backend is handed."""

    request_id: str
    sequences: list[ParsedSequence]
    options: RequestOptions
    vocab_size: int = 0  # the teacher's: the width of a packed answer's ids

    @property
    def packing(self) -> Packing | None:
        """The bit widths of a packed answer (None: the default encoding)."""
        return self.options.packing(self.vocab_size)

    @property
    def num_positions(self) -> int:
        return sum(s.end - s.start for s in self.sequences)

    def response_bytes(self) -> int:
        """Bytes of the payload arrays this request will produce."""
        return sum(
            (s.end - s.start) * self.options.bytes_per_row(self.vocab_size, s.num_candidates)
            for s in self.sequences
        )


def parse_request(req: pb.ScoreRequest, limits: Limits) -> ParsedRequest:
    """Validate ``req`` against ``limits``; raise the typed error of the first problem."""
    check_sequence_count(len(req.sequences))
    if req.samples:  # a sampled payload has top_k = samples columns, held to max_samples
        check_samples(int(req.samples), limits)
    else:
        check_top_k(int(req.top_k), limits)
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
        check_range(
            start,
            end,
            n,
            f"sequences[{i}].position_start/position_end",
            f"the sequence's {n} positions",
        )
        candidates = check_candidates(
            seq.candidate_ids,
            int(seq.num_candidates),
            end - start,
            limits,
            f"sequences[{i}].candidate_ids",
            int(req.samples),
        )
        parsed.append(ParsedSequence(ids, start, end, candidates))
    return ParsedRequest(req.request_id, parsed, options, limits.vocab_size)
