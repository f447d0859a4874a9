"""The sampled loss: cross-entropy against a sparse empirical target drawn from the teacher.

A sampled payload holds, per position, the distinct ids of N draws from the teacher's
distribution `p` (or from a proposal `q ~ p^(1/tau)`), how often each was drawn and the
teacher's log-probs at them. `sampled_target_weights` turns them into target weights
`w_i` with `E[sum_i w_i f(i)] = sum_v p_v f(v)` for any `f` (docs/losses.md):

    w_i = c_i / N                                      draws from p
    w_i = c_i / N * p_i / q_i = c_i / N * exp((1 - 1/tau) log p_i + log Z)    draws from q

and `sampled_kl_loss` is `sum_i w_i (log w_i - log q_i)` per position (q the student's
`softmax(z / T)`), whose gradient w.r.t. the student logits, `(sum_i w_i) q - w` scattered
at the drawn ids, is an unbiased estimate of the full-vocabulary forward-KL gradient
`q - p`. It runs on the kernels of `topk_kl_loss` (mode "truncated", the forward KL, the
drawn ids as the columns, padding columns marked absent), so the chunked, fused and
vocab-parallel paths are the same code, with no host sync under `validate=False`.

Refused (ValueError naming the option): the reverse KL and the JSD (both need the
teacher's log-probs where the *student* puts its mass; draws from the teacher give no
unbiased estimate of those terms), and the options of the top-k loss that have no
meaning here (`mode` "tail_actual", `clamp_min`, `overlap`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from student_client.losses.api import TeacherRows, chunked_loss, fused_loss
from student_client.losses.masking import counted_positions, neutralize_uncounted
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.types import TopKKLStats
from student_client.losses.validation import (
    check_linear,
    check_mask_values,
    check_sample_values,
    check_tensors,
)

__all__ = ["fused_sampled_kl_loss", "sampled_kl_loss", "sampled_target_weights"]

_IDS, _WEIGHTS = "sample_ids", "sample_weights"


def sampled_target_weights(
    counts: Tensor,
    teacher_logprobs: Tensor | None = None,
    *,
    proposal_temperature: float = 1.0,
    proposal_log_normalizer: Tensor | None = None,
) -> Tensor:
    """The unbiased target weights of a sampled payload, `[..., K]` float32 (float64 for
    float64 log-probs); 0 on padding columns (count 0) and on rows with no draws.

    Args:
        counts: `[..., K]` draws of each column's id (a payload's `sample_counts`); a row
            sums to N.
        teacher_logprobs: `[..., K]` the teacher's log-probs at the drawn ids (needed
            with a tempered proposal only).
        proposal_temperature: `tau` the payload was drawn at (1: from `p` itself).
        proposal_log_normalizer: `[...]` `log Z` of the proposal (the payload's
            `proposal_log_normalizer`), needed when `tau != 1`.
    """
    dtype = (
        torch.float64
        if teacher_logprobs is not None and teacher_logprobs.dtype == torch.float64
        else torch.float32
    )
    c = counts.to(dtype)
    weights = c / c.sum(-1, keepdim=True).clamp_min(1)
    if proposal_temperature == 1.0:
        return weights
    if teacher_logprobs is None or proposal_log_normalizer is None:
        raise ValueError(
            "proposal_log_normalizer: a payload drawn at proposal_temperature "
            f"{proposal_temperature:g} needs teacher_logprobs and proposal_log_normalizer "
            "for its importance weights"
        )
    log_ratio = teacher_logprobs.to(dtype) * (1.0 - 1.0 / proposal_temperature)
    log_ratio = log_ratio + proposal_log_normalizer.to(dtype).unsqueeze(-1)
    drawn = counts > 0
    return torch.where(drawn, weights * log_ratio.masked_fill(~drawn, 0.0).exp(), 0.0)


def _sampled_options(options: LossOptions | None, overrides: dict[str, Any]) -> LossOptions:
    """`LossOptions` for the sampled loss: the forward KL on the drawn columns alone."""
    opts = LossOptions.build(options, **overrides)
    divergence = opts.resolved_divergence.name
    if divergence != "forward":
        raise ValueError(
            f"divergence: the sampled loss supports 'forward' only, got {divergence!r}: the "
            "reverse KL and the JSD need the teacher's log-probs where the student puts its "
            "mass, which draws from the teacher do not estimate without bias (use "
            "topk_kl_loss on a top-k payload for them)"
        )
    if opts.mode == "tail_actual":
        raise ValueError("mode: 'tail_actual' does not apply to the sampled loss")
    if opts.clamp_min is not None:
        raise ValueError("clamp_min: does not apply to the sampled loss (its loss is >= 0)")
    if opts.overlap:
        raise ValueError("overlap: the top-k overlap statistic does not apply to draws")
    if opts.support != "teacher":
        raise ValueError(
            f"support: {opts.support!r} does not apply to the sampled loss (its columns are "
            "the draws; use topk_kl_loss with candidate ids for the student's support)"
        )
    return dataclasses.replace(opts, mode="truncated")


def _sampled_rows(
    sample_ids: Tensor,
    sample_weights: Tensor,
    mask: Tensor | None,
    teacher_logprobs: Tensor | None,
    opts: LossOptions,
    shard: VocabShard,
    student: Tensor,
) -> TeacherRows:
    """Flat columns `[N, K]`: ids, log-weights (`-inf` on padding), the counted
    positions, the drawn columns as `present`, and the loss-value offset
    `sum_i w_i (log p_i - log w_i)` when `teacher_logprobs` is given."""
    n_positions = student[..., 0].numel() if student.dim() else 0
    top_k = sample_ids.shape[-1]
    ids = sample_ids.reshape(n_positions, top_k)
    weights = sample_weights.detach().reshape(n_positions, top_k)
    counted = counted_positions(mask, n_positions, student.device)
    if opts.validate:
        check_mask_values(mask)
        check_sample_values(ids[counted], weights[counted], shard.global_vocab)
    drawn = weights > 0
    log_weights = torch.where(
        drawn, weights.clamp_min(torch.finfo(weights.dtype).tiny).log(), -math.inf
    )
    present = drawn & counted.unsqueeze(-1)
    # padding columns hold anything: distinct stand-ins, never gathered (absent)
    stand_in = torch.arange(top_k, device=ids.device, dtype=ids.dtype)
    ids = torch.where(present, ids, stand_in)
    if mask is not None:
        ids, log_weights = neutralize_uncounted(ids, log_weights, counted)
    offset = None
    if teacher_logprobs is not None:
        lp = teacher_logprobs.detach().reshape(n_positions, top_k).to(weights.dtype)
        gap = torch.where(present, lp - log_weights, 0.0)
        offset = (torch.where(present, weights, 0.0) * gap).sum(-1)
    return TeacherRows(ids, log_weights, counted, present, offset)


def sampled_kl_loss(
    logits: Tensor,
    sample_ids: Tensor,
    sample_weights: Tensor,
    mask: Tensor | None = None,
    *,
    teacher_logprobs: Tensor | None = None,
    options: LossOptions | None = None,
    **overrides: Any,
) -> tuple[Tensor, TopKKLStats]:
    """Forward-KL distillation loss against a sampled payload's empirical target.

    Per position, with `q = softmax(z / T)` and target weights `w`
    (`sampled_target_weights`): `sum_i w_i (log w_i - log q_i)`; its gradient
    `(sum_i w_i) q_j - w_j` is an unbiased estimate of the full forward-KL gradient
    `q_j - p_j`. With `teacher_logprobs` the constant `sum_i w_i (log p_i - log w_i)` is
    added, so that the loss value, `sum_i w_i (log p_i - log q_i)`, is an unbiased
    estimate of `KL(p || q)` (the gradient is the same).

    Args:
        logits: student logits `[..., V_local]` (as `topk_kl_loss`).
        sample_ids: `[..., K]` the drawn ids (distinct among the columns with weight > 0;
            a column of weight 0 is padding and may hold anything).
        sample_weights: `[..., K]` target weights, `>= 0`.
        mask: `[...]` positions that count.
        teacher_logprobs: `[..., K]` optional, the teacher's log-probs at the drawn ids.
        options, **overrides: `LossOptions` fields (reduction, chunk_size, temperature,
            process_group, validate). The divergence must be "forward"; `mode`
            "tail_actual", `clamp_min` and `overlap` are refused.

    Returns:
        `(loss, stats)` as `topk_kl_loss`; `stats.teacher_mass` is the mean of
        `sum_i w_i` (1 without a proposal).
    """
    opts = _sampled_options(options, overrides)
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    shard = VocabShard.from_group(opts.process_group, logits.shape[-1] if logits.dim() else 0)
    _check(logits, sample_ids, sample_weights, mask, teacher_logprobs, shard, {})
    rows = _sampled_rows(sample_ids, sample_weights, mask, teacher_logprobs, opts, shard, logits)
    return chunked_loss(logits, rows, opts, shard)


def fused_sampled_kl_loss(
    hidden: Tensor,
    weight: Tensor,
    sample_ids: Tensor,
    sample_weights: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    options: LossOptions | None = None,
    **overrides: Any,
) -> tuple[Tensor, TopKKLStats]:
    """`sampled_kl_loss(hidden @ weight.T + bias, ...)` without forming the logits (the
    kernel of `fused_topk_kl_loss`; arguments as there and in `sampled_kl_loss`)."""
    opts = _sampled_options(options, overrides)
    if not isinstance(hidden, Tensor):
        raise ValueError(f"hidden: must be a torch.Tensor, got {type(hidden).__name__}")
    check_linear(hidden, weight, bias)
    shard = VocabShard.from_group(opts.process_group, weight.shape[0])
    student = {"student_name": "hidden", "last_dim": "H"}
    _check(hidden, sample_ids, sample_weights, mask, teacher_logprobs, shard, student)
    rows = _sampled_rows(sample_ids, sample_weights, mask, teacher_logprobs, opts, shard, hidden)
    return fused_loss(hidden, weight, bias, rows, opts, shard)


def _check(
    student: Tensor,
    sample_ids: Tensor,
    sample_weights: Tensor,
    mask: Tensor | None,
    teacher_logprobs: Tensor | None,
    shard: VocabShard,
    names: dict[str, str],
) -> None:
    """Types, shapes and devices (no value checks, nothing syncs)."""
    check_tensors(
        student,
        sample_ids,
        sample_weights,
        mask,
        global_vocab=shard.global_vocab,
        ids_name=_IDS,
        values_name=_WEIGHTS,
        **names,
    )
    if teacher_logprobs is not None and (
        not isinstance(teacher_logprobs, Tensor) or teacher_logprobs.shape != sample_ids.shape
    ):
        raise ValueError(
            f"teacher_logprobs: must be None or a tensor shaped like sample_ids "
            f"{list(sample_ids.shape)}"
        )
