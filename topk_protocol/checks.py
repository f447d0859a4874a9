"""Input rules, each written once: what a request may ask of a teacher, and a stream's depth.

Every rule raises a typed error (:mod:`topk_protocol.errors`) whose message names the
field and the limit. The limits are data, :class:`TeacherLimits`: the server passes its
own (``teacher_server.validation.Limits`` is one), the client and replay the ones a
teacher announces in ``TeacherInfo`` (:meth:`TeacherLimits.of_info`), so that a request
refused before it leaves is refused with the live teacher's words. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol.errors import InvalidRequestError, ResourceExhaustedError

#: Largest ``samples`` N of a sampled request: a row's counts travel as uint8.
MAX_SAMPLES = 255
#: Largest ``seed`` of a sampled request (a uint64).
MAX_SEED = (1 << 64) - 1

__all__ = [
    "MAX_SAMPLES",
    "MAX_SEED",
    "TeacherLimits",
    "check_depth",
    "check_range",
    "check_samples",
    "check_sequence_count",
    "check_sequence_length",
    "check_token_ids",
    "check_top_k",
    "check_total_tokens",
]


@dataclass(frozen=True)
class TeacherLimits:
    """What a teacher accepts: token ids in ``[0, vocab_size)``, K in ``[1, max_top_k]``,
    at most ``max_tokens_per_request`` tokens in one request and ``max_sequence_length``
    in one sequence (0: no limit of that kind); sampled payloads of at most
    ``max_samples`` draws (0: none)."""

    vocab_size: int
    max_top_k: int
    max_tokens_per_request: int = 0
    max_sequence_length: int = 0
    max_samples: int = 0

    @classmethod
    def of_info(cls, info: Any) -> TeacherLimits:
        """The limits a teacher announces (a ``TeacherInfo`` message or
        :class:`topk_protocol.TeacherInfo`)."""
        return cls(
            vocab_size=int(info.vocab_size),
            max_top_k=int(info.max_top_k),
            max_tokens_per_request=int(info.max_tokens_per_request),
            max_sequence_length=int(info.max_sequence_length),
            max_samples=int(getattr(info, "max_samples", 0)),
        )


def check_top_k(top_k: int, limits: TeacherLimits, field: str = "top_k") -> None:
    """K within ``[1, limits.max_top_k]``; ``field`` names it (the HTTP routes name their
    own field, e.g. ``top_logprobs``)."""
    if not 1 <= top_k <= limits.max_top_k:
        raise InvalidRequestError(
            f"{field}: {top_k} is outside [1, {limits.max_top_k}] (max_top_k)"
        )


def check_samples(samples: int, limits: TeacherLimits, field: str = "samples") -> None:
    """A sampled request's ``samples`` N (0: not sampled) within ``[1, max_samples]``;
    a teacher that draws none (``max_samples`` 0) refuses every sampled request."""
    if samples and not 1 <= samples <= limits.max_samples:
        if limits.max_samples == 0:
            raise InvalidRequestError(
                f"{field}: {samples}, but this teacher serves no sampled payloads (max_samples 0)"
            )
        raise InvalidRequestError(
            f"{field}: {samples} is outside [1, {limits.max_samples}] (max_samples)"
        )


def check_sequence_count(count: int, field: str = "sequences") -> None:
    """A request carries at least one sequence."""
    if count < 1:
        raise InvalidRequestError(f"{field}: empty; a request needs at least 1 sequence")


def check_total_tokens(total: int, limits: TeacherLimits, field: str = "sequences") -> None:
    """A request's tokens in total within ``max_tokens_per_request`` (a limit the request
    itself must respect: RESOURCE_EXHAUSTED, not retried)."""
    if limits.max_tokens_per_request and total > limits.max_tokens_per_request:
        raise ResourceExhaustedError(
            f"{field}: {total} tokens in total exceeds max_tokens_per_request "
            f"{limits.max_tokens_per_request}; split the batch"
        )


def check_sequence_length(length: int, field: str, limits: TeacherLimits | None = None) -> None:
    """One sequence holds at least one token and, with ``limits``, at most
    ``max_sequence_length``; ``field`` names the sequence."""
    if length < 1:
        raise InvalidRequestError(f"{field}: empty; a sequence needs at least 1 token")
    if limits is not None and limits.max_sequence_length and length > limits.max_sequence_length:
        raise InvalidRequestError(
            f"{field}: length {length} exceeds max_sequence_length {limits.max_sequence_length}"
        )


def check_token_ids(ids: npt.NDArray[np.integer], limits: TeacherLimits, field: str) -> None:
    """One sequence's ids ``[L]``: a length :func:`check_sequence_length` accepts, every id
    in the vocabulary ``[0, vocab_size)``; ``field`` names the sequence (``field[j]`` the
    first bad id)."""
    check_sequence_length(len(ids), field, limits)
    vocab_size = limits.vocab_size
    if int(ids.min()) >= 0 and int(ids.max()) < vocab_size:
        return
    j = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
    raise InvalidRequestError(
        f"{field}[{j}]: {int(ids[j])} is outside the vocabulary [0, {vocab_size})"
    )


def check_range(start: int, end: int, limit: int, field: str, inside: str) -> None:
    """Rows ``[start, end)`` with ``0 <= start <= end <= limit``; ``field`` names the
    range, ``inside`` what it must lie in (e.g. ``the sequence's 5 positions``)."""
    if not 0 <= start <= end <= limit:
        raise InvalidRequestError(
            f"{field}: [{start}, {end}) is not a range inside {inside} [0, {limit}]"
        )


def check_depth(depth: int) -> int:
    """A stream's prefetch ``depth`` (requests in flight ahead of the caller): an int
    ``>= 0``; returns it. ``ValueError`` otherwise (a caller's argument, not a request)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
    return depth
