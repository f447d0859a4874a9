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
#: Longest name of a student tokenizer (``ScoreRequest.student_tokenizer``).
MAX_STUDENT_TOKENIZER_NAME = 128

__all__ = [
    "MAX_LOGPROB_BITS",
    "MAX_SAMPLES",
    "MAX_SEED",
    "MAX_STUDENT_TOKENIZER_NAME",
    "MIN_LOGPROB_BITS",
    "TeacherLimits",
    "check_candidates",
    "check_candidates_unsampled",
    "check_depth",
    "check_encoding",
    "check_logprob_bits",
    "check_range",
    "check_samples",
    "check_sequence_count",
    "check_sequence_length",
    "check_token_ids",
    "check_top_k",
    "check_total_tokens",
]


#: The bits a packed request may ask per log-prob code: 1 bit is two grid points per
#: row; 16 bits is finer than float16 for every row (docs/protocol.md, "Packed payloads").
MIN_LOGPROB_BITS = 1
MAX_LOGPROB_BITS = 16


@dataclass(frozen=True)
class TeacherLimits:
    """What a teacher accepts: token ids in ``[0, vocab_size)``, K in ``[1, max_top_k]``,
    at most ``max_tokens_per_request`` tokens in one request and ``max_sequence_length``
    in one sequence (0: no limit of that kind), at most ``max_candidates`` candidate
    ids per position (0: it scores no candidates) and sampled payloads of at most
    ``max_samples`` draws (0: none)."""

    vocab_size: int
    max_top_k: int
    max_tokens_per_request: int = 0
    max_sequence_length: int = 0
    max_candidates: int = 0
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
            max_candidates=int(getattr(info, "max_candidates", 0)),
            max_samples=int(getattr(info, "max_samples", 0)),
        )


def check_top_k(top_k: int, limits: TeacherLimits, field: str = "top_k") -> None:
    """K within ``[1, limits.max_top_k]``; ``field`` names it (the HTTP routes name their
    own field, e.g. ``top_logprobs``)."""
    if not 1 <= top_k <= limits.max_top_k:
        raise InvalidRequestError(
            f"{field}: {top_k} is outside [1, {limits.max_top_k}] (max_top_k)"
        )


def check_logprob_bits(bits: Any, field: str = "logprob_bits") -> int:
    """A packed request's bits per log-prob code: an int in ``[MIN_LOGPROB_BITS,
    MAX_LOGPROB_BITS]``; returns it."""
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise InvalidRequestError(f"{field}: expected an int, got {bits!r}")
    if not MIN_LOGPROB_BITS <= bits <= MAX_LOGPROB_BITS:
        raise InvalidRequestError(
            f"{field}: {bits} is outside [{MIN_LOGPROB_BITS}, {MAX_LOGPROB_BITS}]"
        )
    return int(bits)


def check_encoding(encoding: str, supported: Any, field: str = "encoding") -> None:
    """A request's payload encoding is one the teacher (or recording) ``supported``
    lists."""
    if encoding not in supported:
        raise InvalidRequestError(
            f"{field}: {encoding!r} is not served by this teacher; it serves "
            f"{', '.join(supported) or 'none'}"
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


def check_candidates_unsampled(samples: int, field: str) -> None:
    """Candidate ids come with top-k payloads only: a sampled request (``samples`` > 0)
    naming them is refused (``field`` names the sequence's ``candidate_ids``)."""
    if samples:
        raise InvalidRequestError(
            f"{field}: candidate ids are not scored in a sampled payload (samples {samples}); "
            "ask them in a top-k request"
        )


def check_candidates(
    raw: bytes,
    num_candidates: int,
    rows: int,
    limits: TeacherLimits,
    field: str,
    samples: int = 0,
) -> npt.NDArray[np.int32] | None:
    """One sequence's candidate ids: ``raw`` int32 little-endian bytes of ``[rows, C]``
    (``rows``: its requested positions, ``C = num_candidates``), ``1 <= C <=
    max_candidates``, every id in ``[-1, vocab_size)`` (``-1`` pads a row), in a request
    of ``samples`` 0 (:func:`check_candidates_unsampled`). Returns the ``[rows, C]`` view
    of ``raw``, or None when it names no candidates (empty, C 0); ``field`` names the
    sequence's ``candidate_ids``."""
    if not raw and not num_candidates:
        return None
    check_candidates_unsampled(samples, field)
    c, limit = int(num_candidates), limits.max_candidates
    if c < 1:
        raise InvalidRequestError(
            f"{field}: {len(raw)} bytes with num_candidates 0; set num_candidates to C"
        )
    if c > limit:
        why = " (this teacher scores no candidates)" if limit == 0 else ""
        raise InvalidRequestError(
            f"{field}: C = {c} candidates per position exceeds max_candidates {limit}{why}"
        )
    if len(raw) % 4:
        raise InvalidRequestError(f"{field}: {len(raw)} bytes is not a multiple of 4 (int32)")
    if len(raw) != 4 * rows * c:
        raise InvalidRequestError(
            f"{field}: {len(raw) // 4} ids, expected [S, C] = [{rows}, {c}] = {rows * c} "
            f"(S: the {rows} requested positions)"
        )
    ids = np.frombuffer(raw, dtype="<i4").reshape(rows, c)
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= limits.vocab_size):
        r, j = (int(a[0]) for a in np.nonzero((ids < -1) | (ids >= limits.vocab_size)))
        raise InvalidRequestError(
            f"{field}[{r}, {j}]: {int(ids[r, j])} is outside [-1, {limits.vocab_size}) "
            "(the vocabulary; -1 pads a row)"
        )
    return ids


def check_depth(depth: int) -> int:
    """A stream's prefetch ``depth`` (requests in flight ahead of the caller): an int
    ``>= 0``; returns it. ``ValueError`` otherwise (a caller's argument, not a request)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
    return depth
