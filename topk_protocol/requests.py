"""Requests: the request options, building and normalizing a ``ScoreRequest``, its sizes.

:class:`RequestOptions` is what a request asks the teacher to compute for each of its
sequences (K, the wire dtype, whether the sampled log-probs come along): one frozen value
that the client builds, :func:`build_request` writes into the message, the server reads
back (:meth:`RequestOptions.from_proto`) and hands to the backend, and recordings and
replay compare against what they hold. A default (dtype, positions, include-sampled) or a
size rule (bytes per row, the one-message rule) is written once here: the client decides
between ``Score`` and ``ScoreStream`` with them, the server validates requests and sizes
its answers with them. Rules in ``docs/protocol.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, TypedDict

import numpy as np

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.checks import (
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STUDENT_TOKENIZER_NAME,
    check_logprob_bits,
)
from topk_protocol.codec import (
    DTYPE_NAMES,
    ENCODING_NAMES,
    dtype_from_name,
    dtype_name,
    itemsize,
)
from topk_protocol.errors import InvalidRequestError
from topk_protocol.packing import DEFAULT_LOGPROB_BITS, Packing, packed_row_bytes

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_INCLUDE_SAMPLED",
    "DEFAULT_MAX_MESSAGE_MB",
    "FRAMING_BYTES",
    "RECORDED",
    "RequestKeywords",
    "RequestOptions",
    "Span",
    "bytes_per_row",
    "fits_one_message",
]

#: ``(position_start, position_end)`` of one sequence: rows ``[start, end)``.
Span = tuple[int, int]

#: Wire dtype of the log-probs when a request leaves it unset.
DEFAULT_DTYPE = pb.LOGPROB_DTYPE_FLOAT16

#: Whether a request (and a payload dataset) carries the log-prob of the token that
#: actually follows each position when the caller leaves it unset: the one default of
#: ``include_sampled`` (``RequestOptions``, ``PayloadDataset``; an unset wire field too).
DEFAULT_INCLUDE_SAMPLED = True

#: Default gRPC message-size limit, in MiB, of the server (``--max-message-mb``) and of
#: the client (``max_message_mb``): one value, so that both sides agree out of the box.
DEFAULT_MAX_MESSAGE_MB = 64

#: Room left for protobuf framing, per payload and per message, when deciding whether an
#: answer fits in one message (the arrays dominate; tags and varints take a few bytes).
FRAMING_BYTES = 64


#: ``field(metadata=RECORDED)``: a request option a recording must have been made at to
#: answer it (see :meth:`RequestOptions.recorded`).
RECORDED: Mapping[str, str] = MappingProxyType({"replay": "recorded"})


def _is_recorded(f: Any) -> bool:
    return f.metadata.get("replay") == RECORDED["replay"]


class RequestKeywords(TypedDict, total=False):
    """The request options a client call takes by keyword (``score(seqs, 16, dtype=...)``),
    the fields of :class:`RequestOptions` besides ``top_k``: one list that every client's
    ``score`` / ``stream`` signature unpacks (``**options: Unpack[RequestKeywords]``), so an
    IDE lists them and a type checker checks them."""

    dtype: str
    include_sampled: bool
    encoding: str
    logprob_bits: int | None
    samples: int
    seed: int | None
    proposal_temperature: float
    student_tokenizer: str | None


@dataclass(frozen=True)
class RequestOptions:
    """What the teacher computes for every sequence of one request: everything a
    ``ScoreRequest`` asks for besides the tokens, their positions and the request id.

    Attributes:
        top_k: K, the number of (id, log-prob) pairs per position (``>= 1``; the server
            also holds it to its ``max_top_k``).
        dtype: wire dtype of the log-probs: ``"float16"`` (the default), ``"bfloat16"``
            or ``"float32"`` (an enum value is accepted and stored as its name).
        include_sampled: whether the answer carries the log-prob of the token that
            actually follows each position.
        encoding: ``"default"`` (int32 ids, log-probs in ``dtype``) or ``"packed"`` (ids
            at ``ceil(log2 V)`` bits, log-probs on a per-row grid; docs/protocol.md).
        logprob_bits: packed only: bits per log-prob code, in ``[1, 16]``; None (the
            default) means 8 when packed.
        samples: N > 0 asks for a sampled payload (``docs/protocol.md``): N draws per
            position, each row's distinct drawn ids with their counts, ``top_k`` must be
            N (one column per draw); 0 (the default): the top-k payload.
        seed: the draws' seed, in ``[0, 2^64)``; required with ``samples``, refused
            without.
        proposal_temperature: with ``samples``: draw from ``q ~ p^(1/tau)`` (tau > 1
            flattens, < 1 sharpens) and carry ``log Z`` of ``q`` per row for the
            importance weights; 1 (the default) draws from the teacher's ``p``.
        student_tokenizer: the name of a student tokenizer the teacher serves
            (``TeacherInfo.student_tokenizers``): the request's ids are that tokenizer's
            and so are the answer's, whose rows that end inside a teacher token are masked
            (docs/cross_tokenizer.md); None (the default): the teacher's own ids.

    Adding an option means a field of ``ScoreRequest`` in ``teacher.proto``, a field
    here (with its lines in :meth:`to_proto` / :meth:`from_proto`), and the backends that
    act on it; the clients take it by keyword and pass it through. A field whose
    ``metadata`` is :data:`RECORDED` is one a recording is made at: the recorder stores
    its value and replay answers only requests asking for that value
    (:mod:`topk_protocol.recording.replay`); ``top_k``, ``dtype`` and ``include_sampled`` have
    replay rules of their own.
    """

    top_k: int
    dtype: str = dtype_name(DEFAULT_DTYPE)
    include_sampled: bool = DEFAULT_INCLUDE_SAMPLED
    encoding: str = "default"
    logprob_bits: int | None = None
    samples: int = field(default=0, metadata=RECORDED)
    seed: int | None = field(default=None, metadata=RECORDED)
    proposal_temperature: float = field(default=1.0, metadata=RECORDED)
    student_tokenizer: str | None = field(default=None, metadata=RECORDED)

    def __post_init__(self) -> None:
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise InvalidRequestError(f"top_k: expected an int >= 1, got {k!r}")
        try:
            name = dtype_name(dtype_from_name(self.dtype))
        except (ValueError, KeyError) as e:
            raise InvalidRequestError(str(e)) from None
        if not isinstance(self.include_sampled, bool | np.bool_):
            raise InvalidRequestError(
                f"include_sampled: expected a bool, got {self.include_sampled!r}"
            )
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "include_sampled", bool(self.include_sampled))
        if self.encoding not in ENCODING_NAMES:
            raise InvalidRequestError(
                f"encoding: {self.encoding!r} is not one of {', '.join(ENCODING_NAMES)}"
            )
        if self.encoding == "packed":
            bits = DEFAULT_LOGPROB_BITS if self.logprob_bits is None else self.logprob_bits
            object.__setattr__(self, "logprob_bits", check_logprob_bits(bits))
        elif self.logprob_bits is not None:
            raise InvalidRequestError(
                f"logprob_bits: {self.logprob_bits!r} asked with encoding "
                f"{self.encoding!r}; it applies to encoding 'packed' only"
            )
        self._check_sampling()
        self._check_student_tokenizer()

    def _check_student_tokenizer(self) -> None:
        """A student tokenizer's name, and what its answer cannot carry."""
        name = self.student_tokenizer
        if name is None:
            return
        if not isinstance(name, str) or not 0 < len(name) <= MAX_STUDENT_TOKENIZER_NAME:
            raise InvalidRequestError(
                f"student_tokenizer: expected a name of 1..{MAX_STUDENT_TOKENIZER_NAME} "
                f"characters, got {name!r}"
            )
        if self.sampled:
            raise InvalidRequestError(
                f"student_tokenizer: {name!r} is served with top-k payloads only (a sampled "
                "payload draws teacher tokens, which a student row cannot carry); ask "
                "samples 0"
            )
        if self.encoding != "default":
            raise InvalidRequestError(
                f"encoding: {self.encoding!r} with student_tokenizer {name!r} is not served "
                "(the packed grid holds finite log-probs only: a masked row's are NaN, a "
                "row's padding columns -inf); ask encoding 'default'"
            )

    def _check_sampling(self) -> None:
        """The sampled-payload options: N, the seed, the proposal and top_k = N."""
        n, seed, tau = self.samples, self.seed, self.proposal_temperature
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= MAX_SAMPLES:
            raise InvalidRequestError(
                f"samples: {n!r} is outside [0, {MAX_SAMPLES}] (0: a top-k payload; the "
                "counts travel as uint8)"
            )
        if isinstance(tau, bool) or not isinstance(tau, int | float | np.floating):
            raise InvalidRequestError(f"proposal_temperature: expected a number, got {tau!r}")
        if not (math.isfinite(tau) and tau > 0):
            raise InvalidRequestError(f"proposal_temperature: {tau!r} is not a finite number > 0")
        if seed is not None and (
            isinstance(seed, bool)
            or not isinstance(seed, int | np.integer)
            or not 0 <= seed <= MAX_SEED
        ):
            raise InvalidRequestError(f"seed: {seed!r} is outside [0, {MAX_SEED}] (uint64)")
        if n == 0:
            if seed is not None or tau != 1.0:
                name = "seed" if seed is not None else "proposal_temperature"
                raise InvalidRequestError(
                    f"{name}: applies to sampled payloads only; set samples (1..{MAX_SAMPLES})"
                )
        else:
            if seed is None:
                raise InvalidRequestError(
                    f"seed: required with samples {n} (the draws must be reproducible)"
                )
            if self.top_k != n:
                raise InvalidRequestError(
                    f"top_k: {self.top_k}, but a sampled payload has one column per draw: "
                    f"top_k must equal samples ({n})"
                )
            if self.encoding != "default":
                raise InvalidRequestError(
                    f"encoding: {self.encoding!r} does not carry sampled payloads (the packed "
                    "grid needs rows sorted by log-prob; sampled rows are sorted by id); ask "
                    "samples with encoding 'default'"
                )
        object.__setattr__(self, "samples", int(n))
        object.__setattr__(self, "seed", None if seed is None else int(seed))
        object.__setattr__(self, "proposal_temperature", float(tau))

    @property
    def sampled(self) -> bool:
        """Whether this asks for a sampled payload (``samples > 0``)."""
        return self.samples > 0

    @property
    def proposal_normalizer(self) -> bool:
        """Whether the answer carries ``proposal_log_normalizer`` (a tempered proposal)."""
        return self.samples > 0 and self.proposal_temperature != 1.0

    @classmethod
    def of(cls, top_k: int | RequestOptions | None = None, **options: Any) -> RequestOptions:
        """The options of a call written ``(top_k, dtype=..., include_sampled=...)``,
        ``(samples=N, seed=S)`` (K is N: no ``top_k`` to repeat) or
        ``(RequestOptions(...), <overrides>)``; an unknown keyword raises ``TypeError``
        naming the options there are."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"{', '.join(unknown)}: not a request option; the options are "
                f"{', '.join(sorted(known))}"
            )
        if isinstance(top_k, RequestOptions):
            return replace(top_k, **options) if options else top_k
        if top_k is None:
            samples = options.get("samples", 0)
            if not samples:
                raise InvalidRequestError(
                    "top_k: required (or samples=N for a sampled payload, whose K is N)"
                )
            top_k = int(samples)
        return cls(top_k, **options)

    @property
    def wire_dtype(self) -> int:
        """The ``LogprobDtype`` enum value of :attr:`dtype`."""
        return DTYPE_NAMES[self.dtype]

    @property
    def wire_encoding(self) -> int:
        """The ``PayloadEncoding`` enum value of :attr:`encoding`."""
        return ENCODING_NAMES[self.encoding]

    def packing(self, vocab_size: int) -> Packing | None:
        """The bit widths of a packed answer from a teacher of ``vocab_size`` tokens; None
        for the default encoding."""
        if self.logprob_bits is None:
            return None
        return Packing.of(vocab_size, self.logprob_bits)

    def bytes_per_row(self, vocab_size: int = 0, num_candidates: int = 0) -> int:
        """Payload bytes of one position with ``num_candidates`` candidate ids (see
        :func:`bytes_per_row`); a packed row's depends on the teacher's ``vocab_size``
        (0, unknown: counted at 32 bits per id, an upper bound). Candidate log-probs
        travel unpacked in the wire dtype in either encoding (a packed request is never
        sampled)."""
        if self.logprob_bits is None:
            return bytes_per_row(
                self.top_k,
                self.wire_dtype,
                self.include_sampled,
                num_candidates,
                sampled=self.sampled,
                proposal_normalizer=self.proposal_normalizer,
            )
        candidates = bytes_per_row(0, self.wire_dtype, False, num_candidates)
        return candidates + packed_row_bytes(
            self.top_k,
            vocab_size or 1 << 32,
            self.logprob_bits,
            itemsize(self.wire_dtype),
            self.include_sampled,
        )

    def recorded(self) -> dict[str, Any]:
        """The values of the :data:`RECORDED` options (what a recording is made at)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if _is_recorded(f)}

    @classmethod
    def recorded_defaults(cls) -> dict[str, Any]:
        """The :data:`RECORDED` options' defaults: what a recording made before an option
        existed was made at."""
        return {f.name: f.default for f in fields(cls) if _is_recorded(f)}

    def to_proto(self, request: pb.ScoreRequest) -> pb.ScoreRequest:
        """Write these options into ``request`` (defaults left unset); returns it."""
        request.top_k = self.top_k
        request.dtype = self.wire_dtype  # type: ignore[assignment]
        if self.include_sampled != DEFAULT_INCLUDE_SAMPLED:
            request.include_sampled_logprobs = self.include_sampled
        if self.logprob_bits is not None:
            request.encoding = self.wire_encoding  # type: ignore[assignment]
            request.logprob_bits = self.logprob_bits
        if self.sampled:  # a request without sampling stays byte-identical
            request.samples = self.samples
            assert self.seed is not None  # _check_sampling
            request.seed = self.seed
            if self.proposal_temperature != 1.0:
                request.proposal_temperature = self.proposal_temperature
        if self.student_tokenizer is not None:
            request.student_tokenizer = self.student_tokenizer
        return request

    @classmethod
    def from_proto(cls, request: pb.ScoreRequest) -> RequestOptions:
        """The options of a received request: unset fields take their defaults. Raises
        :class:`InvalidRequestError` naming the field (``top_k`` 0, an unknown dtype)."""
        try:
            dtype = dtype_from_name(int(request.dtype))
        except ValueError:
            raise InvalidRequestError(
                f"dtype: unknown log-prob dtype {request.dtype}; supported: "
                + ", ".join(f"{v} ({k})" for k, v in DTYPE_NAMES.items())
            ) from None
        sampled = (
            bool(request.include_sampled_logprobs)
            if request.HasField("include_sampled_logprobs")
            else DEFAULT_INCLUDE_SAMPLED
        )
        names = {v: k for k, v in ENCODING_NAMES.items()}
        if int(request.encoding) not in names:
            raise InvalidRequestError(
                f"encoding: unknown payload encoding {request.encoding}; supported: "
                + ", ".join(f"{v} ({k})" for k, v in ENCODING_NAMES.items())
            )
        bits = int(request.logprob_bits) if request.HasField("logprob_bits") else None
        return cls(
            int(request.top_k),
            dtype_name(dtype),
            sampled,
            names[request.encoding],
            bits,
            samples=int(request.samples),
            seed=int(request.seed) if request.HasField("seed") else None,
            proposal_temperature=(
                float(request.proposal_temperature)
                if request.HasField("proposal_temperature")
                else 1.0
            ),
            student_tokenizer=request.student_tokenizer or None,
        )


# -- sizes ---------------------------------------------------------------------------------
def bytes_per_row(
    top_k: int,
    dtype: int,
    include_sampled: bool,
    num_candidates: int = 0,
    *,
    sampled: bool = False,
    proposal_normalizer: bool = False,
) -> int:
    """Payload bytes of one position: K ids (int32) + K log-probs (+ the sampled log-prob)
    (+ ``num_candidates`` candidate log-probs; their ids are the request's); a sampled
    payload adds K uint8 counts (+ one ``proposal_log_normalizer``)."""
    size = itemsize(dtype)
    per_column = 4 + size + (1 if sampled else 0)
    per_row = (size if include_sampled else 0) + (size if proposal_normalizer else 0)
    return top_k * per_column + per_row + num_candidates * size


def fits_one_message(payload_bytes: int, num_sequences: int, max_message_bytes: int) -> bool:
    """The one-message rule: a unary ``Score`` answer of ``payload_bytes`` array bytes over
    ``num_sequences`` sequences fits in ``max_message_bytes`` once framing is counted."""
    return payload_bytes + FRAMING_BYTES * (num_sequences + 1) <= max_message_bytes
