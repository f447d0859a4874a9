"""The training signals `benchmarks/quality_cross_tokenizer.py` compares, one pure loss per
arm, and the metric that makes students of different tokenizers comparable.

Row ``t`` of a batch is the distribution of token ``t + 1`` (``logits[:, t]``), as in the
protocol. A cross-tokenizer payload masks the rows that end inside a teacher token (NaN
log-probs) and carries the chain-rule log-prob of the actual next token where that token
is spelled by whole teacher tokens (its ``sampled_logprobs``; NaN elsewhere).

>>> import torch
>>> logits = torch.zeros(1, 3, 5)  # a uniform student over 5 ids
>>> ids = torch.tensor([[0, 1, 2]])
>>> round(float(cross_entropy(logits, ids, torch.ones(1, 3, dtype=torch.bool))), 4)
1.6094
>>> chain = torch.tensor([[-1.6094, float("nan"), float("nan")]])  # the teacher agrees
>>> float(actual_token_kl(logits, ids, chain)) < 1e-4
True
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from student_client.data.payload import TeacherPayload
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
from student_client.losses.types import LossMode

__all__ = [
    "ARMS",
    "actual_token_kl",
    "cross_entropy",
    "masked_rows",
    "nats_per_byte",
    "predicted_bytes",
    "topk_tail_kl",
]

#: Arm letter -> its teacher signal, which a, c and d add to the text's cross-entropy (b:
#: the cross-entropy alone; e, as TRL ships GOLD, and f: the teacher term alone).
ARMS: dict[str, str] = {
    "a": "same tokenizer as the teacher, served top-k + tail (upper bound)",
    "b": "cross-entropy on the text alone (floor)",
    "c": "actual-token log-prob only (chain rule, what networked peers send)",
    "d": "served aligned top-k + tail (this project)",
    "e": "TRL GOLD (extended ULD + hybrid), teacher in process",
    "f": "served aligned top-k + tail, without the cross-entropy",
}

#: Rows per chunk of the top-k loss (the rows of one step fit in one or two chunks).
CHUNK_ROWS = 2048


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log q(x[t+1] | x[..t])`` ``[B, T-1]`` from ``logits`` ``[B, T, V]`` and ``ids``
    ``[B, T]``."""
    logq = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logq.gather(-1, ids[:, 1:, None]).squeeze(-1)


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the counted ``rows`` ``[B, T]`` (bool; the last
    column never counts: it has no next token). Scalar; 0 when no row counts."""
    counted = rows[:, :-1]
    nll = -_next_token_logprobs(logits, ids)
    return (nll * counted).sum() / counted.sum().clamp(min=1)


def actual_token_kl(logits: torch.Tensor, ids: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """The teacher's actual-token probability as the only signal: per row with a finite
    ``chain`` ``[B, T]`` (``log p`` of token ``t + 1``), the KL between the two-outcome
    distributions ``(p, 1 - p)`` and the student's ``(q, 1 - q)`` of that token. Mean over
    those rows; scalar.

    Off-policy (text the student did not sample), this is what a single teacher log-prob
    per token can teach: how likely the actual token is, not what else was likely. (The
    on-policy use, the reverse-KL estimate ``log q - log p`` as a reward, needs the
    student's own samples.)"""
    target = chain[:, :-1].double()
    counted = torch.isfinite(target)
    log_p = torch.where(counted, target, torch.zeros_like(target)).clamp(max=0.0)
    log_q = _next_token_logprobs(logits, ids).double().clamp(max=-1e-7)
    p = log_p.exp()
    log_not_p = torch.log1p(-p.clamp(max=1 - 1e-7))
    log_not_q = torch.log1p(-log_q.exp())
    kl = p * (log_p - log_q) + (1 - p) * (log_not_p - log_not_q)
    return (kl * counted).sum().float() / counted.sum().clamp(min=1)


def masked_rows(payload: TeacherPayload) -> torch.Tensor:
    """``[B, S]`` bool: real rows the teacher could not answer (they end inside a teacher
    token; their log-probs are NaN)."""
    return payload.mask & payload.logprobs[..., 0].isnan()


def topk_tail_kl(
    logits: torch.Tensor, ids: torch.Tensor, payload: TeacherPayload, mode: LossMode = "tail"
) -> torch.Tensor:
    """The tail-aware top-k forward KL of ``logits`` ``[B, S, V]`` against ``payload``
    (mean over the rows it answers; masked rows skipped). ``ids`` ``[B, S]``: the batch's
    tokens, whose next one is the actual token of mode "tail_actual". Scalar."""
    options = LossOptions(mode=mode, chunk_size=CHUNK_ROWS)
    targets = TeacherTargets.from_payload(payload, input_ids=ids)
    loss, _ = topk_kl_loss(logits, targets, options)
    return loss


def predicted_bytes(ids: list[int], lengths: npt.NDArray[np.int64]) -> int:
    """The bytes a model predicts on ``ids``: every token's but the first's
    (``lengths`` ``[V]``: each id's byte length)."""
    return int(lengths[np.asarray(ids[1:], dtype=np.int64)].sum()) if len(ids) > 1 else 0


@torch.no_grad()
def nats_per_byte(
    model: Any, sequences: list[list[int]], lengths: npt.NDArray[np.int64], batch: int = 8
) -> float:
    """Held-out nats per byte of ``model`` on token ``sequences`` (each read from its first
    token): the summed ``-log q`` of every next token over the bytes of those tokens, so
    that models of different tokenizers on the same texts compare."""
    was_training = model.training
    model.eval()
    nll = 0.0
    for i in range(0, len(sequences), batch):
        group = sequences[i : i + batch]
        width = max(len(s) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        real = torch.zeros(len(group), width, dtype=torch.long)
        rows = torch.zeros(len(group), width, dtype=torch.bool)
        for j, s in enumerate(group):
            ids[j, : len(s)] = torch.tensor(s)
            real[j, : len(s)] = 1
            rows[j, : len(s) - 1] = True
        logits = model(input_ids=ids, attention_mask=real).logits
        logq = _next_token_logprobs(logits, ids)
        nll -= float((logq * rows[:, :-1]).sum())
    model.train(was_training)
    total = sum(predicted_bytes(s, lengths) for s in sequences)
    return nll / total if total else math.nan


def binary_kl_reference(p: float, q: float) -> float:
    """``KL((p, 1-p) || (q, 1-q))`` in plain floats (the tests' reference)."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
