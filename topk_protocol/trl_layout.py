"""Hugging Face TRL's teacher log-prob layout, and how our payload maps onto it.

TRL's ``VLLMClient.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs)`` wants,
for each sequence ``x[0..L-1]`` and its prompt length ``P``, one row per *completion*
position ``p`` in ``[P, L)``: **row ``p`` is the distribution of token ``x[p]`` given
``x[0..p-1]``** (vLLM's prompt log-prob layout). Position 0 has no such distribution:
vLLM gives ``None`` there and TRL turns it into a row of ``-inf`` (ids 0).

Our payload's row ``t`` is the distribution of the *next* token, ``x[t+1]``, given
``x[0..t]`` (docs/protocol.md). So TRL's row ``p`` is our row ``p - 1``, and TRL's
"actual" log-prob at ``p`` (of ``x[p]``) is our ``sampled_logprobs[p - 1]``: a request
for TRL's rows ``[P, L)`` asks us for rows ``[max(P, 1) - 1, L - 1)`` (:func:`trl_span`),
never our last row (the token after the sequence), which TRL does not use.

Pure numpy; the server's HTTP routes (``teacher_server.http_api.trl``) and the drop-in gRPC
client (``student_client.integrations.trl_client``) both check TRL's input with
:func:`check_prompt_lengths` and build TRL's answers from :class:`TRLRows`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol.errors import InvalidRequestError
from topk_protocol.requests import Span

__all__ = [
    "JSON_NEG_INF",
    "TRLRows",
    "check_prompt_lengths",
    "sequence_logprobs_result",
    "trl_rows",
    "trl_span",
]

#: What vLLM's OpenAI server writes for a ``-inf`` prompt log-prob (JSON has no infinity);
#: TRL's rows for position 0 and its padding stay ``-inf`` (made by the client itself).
JSON_NEG_INF = -9999.0


def trl_span(length: int, prompt_length: int) -> Span:
    """Our payload rows ``[start, end)`` that TRL's rows ``[prompt_length, length)`` of a
    sequence of ``length`` tokens come from (``0 <= prompt_length <= length``)."""
    return max(prompt_length, 1) - 1, length - 1


def check_prompt_lengths(prompt_lengths: Any, lengths: Sequence[int]) -> list[int]:
    """TRL's ``prompt_lengths`` for sequences of ``lengths`` tokens: one int ``P`` per
    sequence, ``0 <= P <= L``; returns them as ints. Raises
    :class:`~topk_protocol.errors.InvalidRequestError` naming the field."""
    if isinstance(prompt_lengths, str | bytes) or not isinstance(
        prompt_lengths, Sequence | np.ndarray
    ):
        raise InvalidRequestError(
            f"prompt_lengths: expected one int per sequence, got {type(prompt_lengths).__name__}"
        )
    if len(prompt_lengths) != len(lengths):
        raise InvalidRequestError(
            f"prompt_lengths: {len(prompt_lengths)} values for {len(lengths)} sequences"
        )
    out: list[int] = []
    for i, (p, n) in enumerate(zip(prompt_lengths, lengths, strict=True)):
        if isinstance(p, bool | np.bool_) or not isinstance(p, int | np.integer):
            raise InvalidRequestError(f"prompt_lengths[{i}]: expected an int, got {p!r}")
        if not 0 <= p <= n:
            raise InvalidRequestError(
                f"prompt_lengths[{i}]: {p} is outside [0, {n}] (the sequence's length)"
            )
        out.append(int(p))
    return out


@dataclass(frozen=True)
class TRLRows:
    """TRL's rows of one sequence: completion positions ``[prompt_length, L)``, ``C = L -
    prompt_length`` of them.

    Attributes:
        logprobs: ``[C, K]`` float32, each row sorted descending; ``-inf`` at position 0.
        token_ids: ``[C, K]`` int32; 0 at position 0.
        actual_logprobs: ``[C]`` float32 log p(x[p] | x[..p-1]); ``-inf`` at position 0.
        actual_token_ids: ``[C]`` int32, ``x[p]``.
        has_first: whether position 0 (no distribution) is the first row.
    """

    logprobs: npt.NDArray[np.float32]
    token_ids: npt.NDArray[np.int32]
    actual_logprobs: npt.NDArray[np.float32]
    actual_token_ids: npt.NDArray[np.int32]
    has_first: bool

    @property
    def num_rows(self) -> int:
        return int(self.logprobs.shape[0])


def trl_rows(
    ids: npt.NDArray[Any],
    logprobs: npt.NDArray[Any],
    sampled: npt.NDArray[Any],
    token_ids: npt.NDArray[Any],
    prompt_length: int,
) -> TRLRows:
    """Our rows :func:`trl_span` ``(len(token_ids), prompt_length)`` of one sequence
    (``ids``/``logprobs`` ``[S, K]``, ``sampled`` ``[S]``) -> TRL's rows."""
    n = len(token_ids)
    k = int(ids.shape[1]) if ids.ndim == 2 else 0
    start, end = trl_span(n, prompt_length)
    if ids.shape[0] != end - start:
        raise ValueError(
            f"trl_rows: {ids.shape[0]} rows given, rows [{start}, {end}) needed for a "
            f"sequence of {n} tokens with prompt length {prompt_length}"
        )
    lps = np.asarray(logprobs, dtype=np.float32)
    tids = np.asarray(ids, dtype=np.int32)
    act = np.asarray(sampled, dtype=np.float32)
    has_first = prompt_length == 0 and n > 0
    if has_first:
        lps = np.concatenate([np.full((1, k), -np.inf, np.float32), lps])
        tids = np.concatenate([np.zeros((1, k), np.int32), tids])
        act = np.concatenate([np.full(1, -np.inf, np.float32), act])
    actual_ids = np.asarray(token_ids[prompt_length:n], dtype=np.int32)
    return TRLRows(lps, tids, act, actual_ids, has_first)


def _neg_inf_to_json(values: list[Any]) -> list[Any]:
    """``-inf`` -> :data:`JSON_NEG_INF`, NaN -> ``-inf`` (what TRL's client reads back
    from vLLM's JSON), on one row of Python floats."""
    return [-math.inf if math.isnan(v) else (JSON_NEG_INF if v == -math.inf else v) for v in values]


def sequence_logprobs_result(rows: Sequence[TRLRows]) -> dict[str, list[Any]]:
    """What TRL's ``VLLMClient.get_sequence_logprobs`` (TRL 1.11+) returns for these rows:
    ``logprobs`` / ``logprob_token_ids`` ``[B][C][K]``, ``actual_logprobs`` /
    ``actual_token_ids`` ``[B][C][1]``, Python lists; position 0 is ``-inf`` (ids 0),
    other ``-inf`` values read as vLLM's JSON writes them (:data:`JSON_NEG_INF`)."""
    out: dict[str, list[Any]] = {
        "logprobs": [],
        "logprob_token_ids": [],
        "actual_logprobs": [],
        "actual_token_ids": [],
    }
    for r in rows:
        skip = 1 if r.has_first else 0
        lps = r.logprobs.tolist()
        act = r.actual_logprobs.tolist()
        if np.isneginf(r.logprobs[skip:]).any() or np.isnan(r.logprobs[skip:]).any():
            lps[skip:] = [_neg_inf_to_json(row) for row in lps[skip:]]
        if np.isneginf(r.actual_logprobs[skip:]).any() or np.isnan(r.actual_logprobs).any():
            act[skip:] = _neg_inf_to_json(act[skip:])
        out["logprobs"].append(lps)
        out["logprob_token_ids"].append(r.token_ids.tolist())
        out["actual_logprobs"].append([[v] for v in act])
        out["actual_token_ids"].append([[int(t)] for t in r.actual_token_ids.tolist()])
    return out
