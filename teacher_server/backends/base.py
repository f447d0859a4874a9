"""The backend interface the gRPC servicer talks to, and helpers every backend shares."""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol import DEFAULT_TEACHER_TEMPERATURE

__all__ = [
    "Backend",
    "BackendInfo",
    "ScoredSequence",
    "tokenizer_fingerprint",
    "topk_from_logprobs",
]


@dataclass(frozen=True)
class BackendInfo:
    """What the engine is. ``max_sequence_length`` 0 means no limit of its own; ``dtype``
    is the dtype the engine actually computes in (e.g. ``bfloat16`` for a float32
    checkpoint served with ``--dtype auto`` on CPU), empty when there is no engine;
    ``temperature`` is the teacher temperature ``T`` of every log-prob it serves."""

    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_top_k: int
    max_sequence_length: int = 0
    name: str = "unknown"
    dtype: str = ""
    temperature: float = DEFAULT_TEACHER_TEMPERATURE


@dataclass(frozen=True)
class ScoredSequence:
    """Top-k payload of positions ``[position_start, position_start + S)`` of one sequence.

    ``ids`` ``[S, K]`` int32 and ``logprobs`` ``[S, K]`` float32, rows sorted descending;
    ``sampled_logprobs`` ``[S]`` float32: log p(x[t+1] | x[..t]), NaN at the last position
    of the sequence (docs/protocol.md, position alignment).
    """

    ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    sampled_logprobs: npt.NDArray[np.float32]
    position_start: int = 0
    engine_seconds: float = field(default=0.0, compare=False)


class Backend(abc.ABC):
    """An engine that scores one token sequence at a time.

    Concurrency is the backend's business: the servicer calls :meth:`score` from many
    coroutines at once (vLLM batches them; the transformers backend serialises them).
    """

    info: BackendInfo

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the engine (may take long)."""

    async def warmup(self) -> None:
        """Run a first request so that the first real one is fast."""
        await self.score(np.arange(8, dtype=np.int32) % self.info.vocab_size, 1, 0, 8)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine."""

    def check_request(self, parsed: Any) -> None:  # noqa: B027 - optional hook
        """Refuse a whole request (raise ``RequestError``) before any sequence is scored;
        ``parsed`` is a ``teacher_server.validation.ParsedRequest``. Default: accept."""

    @abc.abstractmethod
    async def score(
        self, token_ids: npt.NDArray[np.int32], top_k: int, start: int, end: int
    ) -> ScoredSequence:
        """Score positions ``[start, end)`` of ``token_ids`` (``[L]``, validated) at ``top_k``."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of the tokenizer's token -> id map, which is what must match between
    a teacher and its student."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def topk_from_logprobs(
    logprobs: npt.NDArray[np.float32], token_ids: npt.NDArray[np.int32], top_k: int
) -> ScoredSequence:
    """Dense ``[L, V]`` log-probs (row t predicts x[t+1]) -> the payload of all L positions.

    Pure numpy; used by the transformers backend and in tests.
    """
    n, v = logprobs.shape
    k = min(top_k, v)
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    lps = np.take_along_axis(vals, order, axis=1).astype(np.float32)
    sampled = np.full(n, np.nan, dtype=np.float32)
    if n > 1:
        sampled[:-1] = logprobs[np.arange(n - 1), token_ids[1:n]]
    return ScoredSequence(ids, lps, sampled)
