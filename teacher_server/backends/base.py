"""The backend interface the gRPC servicer talks to, and helpers every backend shares."""

from __future__ import annotations

import abc
import argparse
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from teacher_server.flags import add_flags, from_args, temperature_arg
from teacher_server.validation import ParsedRequest, ParsedSequence
from topk_protocol import (
    DEFAULT_TEACHER_TEMPERATURE,
    ENCODING_NAMES,
    RequestOptions,
    SequenceArrays,
)
from topk_protocol.fingerprint import AnswerFingerprint
from topk_protocol.sampling import SampledRows, sample_rows, sequence_sample_key

__all__ = [
    "Backend",
    "BackendInfo",
    "ComputeCounts",
    "ModelFlags",
    "gather_candidates",
    "sampled_arrays",
    "sampled_from_logprobs",
    "topk_from_logprobs",
]


@dataclass(frozen=True)
class BackendInfo:
    """What the engine is. ``max_sequence_length`` 0 means no limit of its own; ``dtype``
    is the dtype the engine actually computes in (e.g. ``bfloat16`` for a float32
    checkpoint served with ``--dtype auto`` on CPU), empty when there is no engine;
    ``temperature`` is the teacher temperature ``T`` of every log-prob it serves;
    ``max_candidates`` the most candidate ids per position it scores (0: none; the
    server's ``--max-candidates`` caps it); ``max_samples`` the largest sampled-payload
    N it draws (0: none)."""

    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_top_k: int
    max_sequence_length: int = 0
    name: str = "unknown"
    dtype: str = ""
    temperature: float = DEFAULT_TEACHER_TEMPERATURE
    max_candidates: int = 0
    max_samples: int = 0
    #: Its answers to the canaries, set at start-up (teacher_server.answer_fingerprint).
    answer_fingerprint: AnswerFingerprint | None = None


@dataclass
class ComputeCounts:
    """What an engine computed for the positions it answered, summed since start-up
    (``/metrics``): ``tokens`` sent to the engine (whole sequences), ``cached_tokens`` of
    them read from its prefix cache, ``positions_answered`` (payload rows). The
    positions it computed (forward passes) are ``tokens - cached_tokens``."""

    tokens: int = 0
    cached_tokens: int = 0
    positions_answered: int = 0
    #: Bytes of answers' rows kept now to answer later requests for the same prefix.
    shared_row_bytes: int = 0

    @property
    def positions_computed(self) -> int:
        return self.tokens - self.cached_tokens

    def set_shared_row_bytes(self, nbytes: int) -> None:
        """The bytes of rows kept to share now (a gauge)."""
        self.shared_row_bytes = nbytes

    def add(self, tokens: int, cached_tokens: int, positions_answered: int) -> None:
        self.tokens += tokens
        self.cached_tokens += cached_tokens
        self.positions_answered += positions_answered


@dataclass(frozen=True)
class ModelFlags:
    """The flags of every backend that loads a model (its own ``Flags`` add to them)."""

    model: str
    """model directory (or a name the engine can load)"""
    served_model_name: str | None = None
    """name announced by GetInfo (default: the model's directory)"""
    teacher_temperature: float = field(
        default=DEFAULT_TEACHER_TEMPERATURE, metadata={"type": temperature_arg}
    )
    """serve log_softmax(logits / T) instead of the model's own distribution (announced in
    GetInfo)"""


class Backend(abc.ABC):
    """An engine that scores one token sequence at a time.

    Concurrency is the backend's business: the servicer calls :meth:`score` from many
    coroutines at once (vLLM batches them; the transformers backend serialises them).
    A backend knows nothing of gRPC: it raises the protocol's typed errors
    (:mod:`topk_protocol.errors`), which the servicer maps to status codes.
    """

    info: BackendInfo

    #: What the engine computed (None: the backend does not count it).
    compute: ComputeCounts | None = None

    #: The backend's own command-line flags: a dataclass whose field docstrings are the
    #: help text (:mod:`teacher_server.flags`), read by :meth:`from_flags`.
    Flags: ClassVar[type[Any]]

    #: ``flag dest -> why``: flags of other backends this one refuses, and the reason the
    #: CLI gives (``{}``: the generic message).
    flag_notes: ClassVar[dict[str, str]] = {}

    @classmethod
    def cli_parents(cls) -> list[argparse.ArgumentParser]:
        """Parsers whose flags the ``serve`` parser inherits (an engine's own)."""
        return []

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's flags to the ``serve`` parser."""
        add_flags(parser, cls.Flags, f"{cls.__name__} flags")

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, *, max_top_k: int, reserved: frozenset[str]
    ) -> Backend:
        """The backend the parsed ``args`` describe. ``max_top_k`` is the server's;
        ``reserved`` names the parser's flags that are not this backend's (the server's
        own), which a backend passing flags through to its engine must skip."""
        return cls.from_flags(from_args(cls.Flags, args), max_top_k=max_top_k)

    @classmethod
    def from_flags(cls, flags: Any, *, max_top_k: int) -> Backend:
        """The backend for its :attr:`Flags` value (and the server's ``max_top_k``)."""
        raise NotImplementedError(f"{cls.__name__}: no command-line construction")

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the engine (may take long)."""

    async def warmup(self) -> None:
        """Run a first request so that the first real one is fast."""
        tokens = np.arange(8, dtype=np.int32) % self.info.vocab_size
        await self.score(ParsedSequence(tokens, 0, len(tokens)), RequestOptions(top_k=1))

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine."""

    def engine_alive(self) -> bool:
        """False once the engine is lost for good (its process died): ``/readyz`` then
        answers 503. Called from the HTTP thread: must not block. Default: True."""
        return True

    def drop_caches(self) -> None:  # noqa: B027 - optional hook
        """Forget what the backend keeps of earlier answers to serve later requests
        (called when the server has been idle, before memory is given back). Default:
        nothing kept."""

    async def trim_memory(self) -> int:
        """``malloc_trim`` the engine's own processes (:mod:`teacher_server.malloc_trim`);
        returns the resident bytes given back. Default 0: an engine in the server's
        process is trimmed with it."""
        return 0

    def check_request(self, parsed: ParsedRequest) -> None:  # noqa: B027 - optional hook
        """Refuse a whole request (raise a typed error of :mod:`topk_protocol.errors`)
        before any sequence is scored. Default: accept."""

    @property
    def tokenizer(self) -> Any | None:
        """The engine's tokenizer once started (Hugging Face's interface: ``encode``,
        ``decode``), for the HTTP routes that take text prompts; None (the default):
        this backend takes token ids only."""
        return None

    @property
    def supported_encodings(self) -> tuple[str, ...]:
        """The payload encodings this backend answers (``GetInfo``): every one, by
        default (the packed encoding is the answer path's, not the engine's)."""
        return tuple(ENCODING_NAMES)

    @abc.abstractmethod
    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        """Score positions ``[sequence.start, sequence.end)`` of ``sequence.token_ids``
        (``[L]``, validated) as ``options`` asks (``options.top_k`` columns): ``ids``
        and ``logprobs`` ``[S, K]``, rows sorted descending, and ``sampled_logprobs``
        ``[S]`` (NaN at the last position of the sequence; docs/protocol.md, position
        alignment; a backend may leave it None when ``options`` does not ask for it).
        With ``sequence.candidate_ids`` (``[S, C]``; only when ``info.max_candidates``
        allows): ``candidate_ids`` as given and ``candidate_logprobs`` ``[S, C]`` from the
        same log-softmax as the top-k (:func:`gather_candidates`)."""


def topk_from_logprobs(
    logprobs: npt.NDArray[np.float32], token_ids: npt.NDArray[np.int32], top_k: int
) -> SequenceArrays:
    """Dense ``[L, V]`` log-probs (row t predicts ``token_ids[t+1]``) -> the payload of all
    L positions.

    ``token_ids``: ``[L]`` (the last row has no next token: its sampled log-prob is NaN and
    its rank 0) or ``[L + 1]`` (every row has one). The actual tokens' ranks are vLLM's:
    ``count(row >= row[next])``. Pure numpy; used by the transformers backend and in tests.
    """
    n, v = logprobs.shape
    k = min(top_k, v)
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    lps = np.take_along_axis(vals, order, axis=1).astype(np.float32)
    following = min(n, len(token_ids) - 1)  # rows with a next token
    sampled = np.full(n, np.nan, dtype=np.float32)
    ranks = np.zeros(n, dtype=np.int32)
    if following > 0:
        rows = logprobs[:following]
        actual = rows[np.arange(following), np.asarray(token_ids[1 : following + 1])]
        sampled[:following] = actual
        ranks[:following] = np.count_nonzero(rows >= actual[:, None], axis=1)
    return SequenceArrays(ids, lps, sampled, sampled_ranks=ranks)


def gather_candidates(logprobs: Any, candidate_ids: Any) -> Any:
    """The log-probs at each row's candidate ids, as the teacher serves them.

    Args:
        logprobs: ``[N, V]`` float32 torch tensor (a row's full log-softmax).
        candidate_ids: ``[N, C]`` integer torch tensor on the same device, ids in
            ``[-1, V)``; ``-1`` pads.

    Returns:
        ``[N, C]`` float32: ``logprobs[i, candidate_ids[i, j]]``, NaN where the id is
        ``-1``. One vectorized gather (no per-entry Python), used by every backend so
        that the padding rule is written once.
    """
    import torch

    ids = candidate_ids.to(torch.int64)
    got = logprobs.gather(1, ids.clamp(min=0))
    return torch.where(ids < 0, float("nan"), got)


def sampled_from_logprobs(
    logprobs: Any, token_ids: npt.NDArray[np.int32], start: int, options: RequestOptions
) -> SequenceArrays:
    """A sampled payload of positions ``[start, start + S)`` from the dense served
    log-probs ``logprobs`` ``[S, V]`` (a torch tensor; row ``j`` predicts the token after
    ``token_ids[start + j]``), drawn as ``options`` asks (:mod:`topk_protocol.sampling`)."""
    import torch

    rows = logprobs.shape[0]
    positions = torch.arange(start, start + rows, device=logprobs.device)
    assert options.seed is not None  # RequestOptions requires it with samples
    drawn = sample_rows(
        logprobs,
        options.samples,
        options.seed,
        sequence_sample_key(token_ids),
        positions,
        options.proposal_temperature,
    )
    sampled = None
    if options.include_sampled:
        nxt = positions + 1
        inside = nxt < len(token_ids)
        following = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=logprobs.device)
        index = following[nxt.clamp_max(len(token_ids) - 1)]
        actual = torch.gather(logprobs.float(), 1, index[:, None])[:, 0]
        sampled = torch.where(inside, actual, torch.nan).cpu().numpy()
    return sampled_arrays(drawn, sampled, start)


def sampled_arrays(
    drawn: SampledRows, sampled: npt.NDArray[np.float32] | None, start: int
) -> SequenceArrays:
    """The payload of drawn rows (:class:`~topk_protocol.sampling.SampledRows`, ``[S, N]``
    tensors) and the actual tokens' log-probs ``sampled`` ``[S]`` (or None), whichever
    backend drew them: the one conversion into the payload's sampled fields."""
    return SequenceArrays(
        drawn.ids.cpu().numpy().astype(np.int32),
        drawn.logprobs.cpu().numpy().astype(np.float32),
        sampled,
        start,
        sample_counts=drawn.counts.cpu().numpy().astype(np.uint8),
        proposal_log_normalizer=(
            None
            if drawn.log_normalizer is None
            else drawn.log_normalizer.cpu().numpy().astype(np.float32)
        ),
    )
