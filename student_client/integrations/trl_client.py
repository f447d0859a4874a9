"""``TRLTeacherClient``: TRL's teacher client, answered over our gRPC protocol.

Hugging Face TRL's server-teacher trainers (``ServerDistillationTrainer``, SDFT, SDPO,
IW-OPD, ...) call ``trainer.teacher_client.get_sequence_logprobs(sequences,
prompt_lengths, top_logprobs, temperature)``. This class answers that call with exactly
what TRL's own ``trl.generation.vllm_client.VLLMClient.get_sequence_logprobs`` (TRL 1.11
and later) returns, in TRL's alignment (:mod:`topk_protocol.trl_layout`), but fetches it
from a topk-distill teacher over gRPC with :class:`~student_client.clients.blocking.TeacherClient`:
binary payloads, only the completion rows, retries and fail-over between targets, typed
errors (:mod:`topk_protocol.errors`), several chunks in flight on one stream.

    trainer.teacher_client = TRLTeacherClient("teacher-host:50051")

See docs/trl.md (also for pointing TRL's own client at the teacher's HTTP port).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from student_client.clients.blocking import TeacherClient
from student_client.data.batch import ScoreBatch
from student_client.data.payload import TeacherPayload
from topk_protocol import temperature_mismatch
from topk_protocol._closeable import Closeable
from topk_protocol.errors import InvalidRequestError, TeacherMismatchError
from topk_protocol.requests import RequestOptions
from topk_protocol.trl_layout import (
    TRLRows,
    check_prompt_lengths,
    sequence_logprobs_result,
    trl_rows,
    trl_span,
)

__all__ = ["TRLTeacherClient"]


class TRLTeacherClient(Closeable):
    """A drop-in for TRL's ``VLLMClient`` as a teacher (``get_sequence_logprobs`` only).

    Args:
        target: the teacher's gRPC target(s), as for :class:`TeacherClient`.
        dtype: wire dtype of the log-probs; ``float32`` (default) gives TRL the values the
            engine computed, as its HTTP paths do; ``float16`` / ``bfloat16`` send less.
        **options: :class:`TeacherClient`'s options (``token``, ``tls``, ``timeout_s``,
            ``retries``, ...).

    Each call checks ``temperature`` against the teacher's announced one and raises
    :class:`TeacherMismatchError` naming both when they differ (a top-k answer cannot be
    re-tempered); bad input raises :class:`InvalidRequestError` naming the field.
    """

    def __init__(
        self, target: str | Sequence[str], *, dtype: str = "float32", **options: Any
    ) -> None:
        self._client = TeacherClient(target, **options)
        self._dtype = dtype

    @property
    def client(self) -> TeacherClient:
        """The underlying gRPC client."""
        return self._client

    def _check_temperature(self, temperature: float) -> None:
        served = self._client.info().teacher_temperature
        refusal = temperature_mismatch(temperature, served)
        if refusal is not None:
            raise TeacherMismatchError(f"teacher {self._client.current_target}: {refusal}")

    def get_sequence_logprobs(
        self,
        sequences: list[list[int]],
        prompt_lengths: list[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
    ) -> dict[str, list[Any]]:
        """TRL's ``get_sequence_logprobs``: for each sequence, its completion positions
        ``[prompt_length, L)`` (``C`` of them).

        Returns ``logprobs`` / ``logprob_token_ids`` ``[B][C][K]`` (sorted descending; row
        0 of a sequence with prompt length 0 is ``-inf`` / 0) and ``actual_logprobs`` /
        ``actual_token_ids`` ``[B][C][1]`` (the log-prob of the token that is there).
        ``chunk_size > 0`` sends chunks of that many sequences, ``max_concurrent_requests``
        of them in flight on one stream.
        """
        if temperature <= 0:
            raise InvalidRequestError(f"temperature: must be positive, got {temperature}")
        lengths = [len(seq) for seq in sequences]
        prompt_lengths = check_prompt_lengths(prompt_lengths, lengths)
        spans = [trl_span(n, p) for n, p in zip(lengths, prompt_lengths, strict=True)]
        self._check_temperature(temperature)
        size = chunk_size if chunk_size > 0 else len(sequences)
        starts = range(0, len(sequences), size)
        batches = [ScoreBatch(sequences[s : s + size], spans[s : s + size]) for s in starts]
        options = RequestOptions(top_logprobs, dtype=self._dtype, include_sampled=True)
        payloads: Iterator[TeacherPayload]
        if len(batches) == 1:  # one unary call (a stream when the answer is too large)
            one = batches[0]
            payloads = iter([self._client.score(one.sequences, options, positions=one.positions)])
        else:
            payloads = self._client.stream(
                batches, options, depth=max(max_concurrent_requests - 1, 0)
            )
        rows: list[TRLRows] = []
        for start, payload in zip(starts, payloads, strict=True):
            rows.extend(_rows(payload, sequences[start : start + size], prompt_lengths[start:]))
        return sequence_logprobs_result(rows)

    def close(self) -> None:
        self._client.close()


def _rows(
    payload: TeacherPayload, sequences: list[list[int]], prompt_lengths: Sequence[int]
) -> list[TRLRows]:
    """One batch's payload ``[B, S, K]`` -> TRL's rows per sequence."""
    out = []
    sampled = payload.sampled_logprobs
    if sampled is None:  # pragma: no cover - always asked for
        raise ValueError("payload: no sampled log-probs")
    for b, seq in enumerate(sequences):
        n = int(payload.lengths[b])
        out.append(
            trl_rows(
                payload.ids[b, :n].numpy(),
                payload.logprobs[b, :n].numpy(),
                sampled[b, :n].numpy(),
                np.asarray(seq, dtype=np.int64),
                int(prompt_lengths[b]),
            )
        )
    return out
