"""The sampled loss: cross-entropy against a sparse empirical target drawn from the teacher.

A sampled payload holds, per position, the distinct ids of N draws from the teacher's
distribution `p` (or from a proposal `q ~ p^(1/tau)`), how often each was drawn and the
teacher's log-probs at them. `sampled_target_weights` turns them into target weights
`w_i` with `E[sum_i w_i f(i)] = sum_v p_v f(v)` for any `f` (docs/losses.md):

    w_i = c_i / N                                      draws from p
    w_i = c_i / N * p_i / q_i = c_i / N * exp((1 - 1/tau) log p_i + log Z)    draws from q

and the sampled loss (`topk_kl_loss` / `lm_head_topk_kl_loss` with a `TeacherTargets` that
has `sample_counts`) is `sum_i w_i (log p_i - log q_i)` per position (q the student's
`softmax(z / T)`), whose gradient w.r.t. the student logits, `(sum_i w_i) q - w` scattered
at the drawn ids, is an unbiased estimate of the full-vocabulary forward-KL gradient
`q - p`; the value is an unbiased estimate of `KL(p || q)`. It runs on the kernels of the
top-k loss (mode "truncated", the forward KL, the drawn ids as the columns, padding
columns marked absent, the constant `sum_i w_i (log p_i - log w_i)` as a per-position
offset), so the chunked, fused and vocab-parallel paths are the same code, with no host
sync under `validate=False`. The proposal temperature travels with the teacher value
(`TeacherTargets.proposal_temperature`).

Refused (ValueError naming the option): the reverse KL and the JSD (both need the
teacher's log-probs where the *student* puts its mass; draws from the teacher give no
unbiased estimate of those terms), and the options of the top-k loss that have no
meaning here (`mode` "tail_actual", `clamp_min`, `overlap`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from student_client.losses.input_checks import check_mask_values, check_sample_values
from student_client.losses.masking import counted_positions, neutralize_uncounted
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.support import TeacherRows
from student_client.losses.teacher import TeacherTargets

__all__ = ["sampled_options", "sampled_rows", "sampled_target_weights"]


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


def sampled_options(opts: LossOptions) -> LossOptions:
    """`opts` for the sampled loss: the forward KL on the drawn columns alone (the
    options that have no meaning here are refused, naming the option)."""
    divergence = opts.resolved_divergence.name
    if divergence != "forward":
        raise ValueError(
            f"divergence: the sampled loss supports 'forward' only, got {divergence!r}: the "
            "reverse KL and the JSD need the teacher's log-probs where the student puts its "
            "mass, which draws from the teacher do not estimate without bias (use a top-k "
            "payload for them)"
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
            "the draws; use a top-k payload with candidate ids for the student's support)"
        )
    return dataclasses.replace(opts, mode="truncated")


def sampled_rows(
    student: Tensor, teacher: TeacherTargets, opts: LossOptions, shard: VocabShard
) -> TeacherRows:
    """Flat columns `[N, K]` of a sampled teacher value (shapes checked by the caller):
    the drawn ids, the log-weights (`-inf` on padding), the counted positions, the drawn
    columns as `present`, and the loss-value offset `sum_i w_i (log p_i - log w_i)`."""
    counts = teacher.sample_counts
    assert counts is not None  # the caller's `teacher.is_sampled`
    if not isinstance(counts, Tensor) or counts.shape != teacher.ids.shape:
        raise ValueError(
            f"teacher.sample_counts: must be a tensor shaped like teacher.ids "
            f"{list(teacher.ids.shape)}"
        )
    if counts.device != student.device:
        raise ValueError(
            f"teacher.sample_counts: is on {counts.device}, the student on {student.device}"
        )
    n_positions = student[..., 0].numel() if student.dim() else 0
    top_k = teacher.ids.shape[-1]
    mask = teacher.mask
    ids = teacher.ids.reshape(n_positions, top_k)
    counted = counted_positions(mask, n_positions, student.device)
    if opts.validate:
        check_mask_values(mask)
        check_sample_values(
            ids[counted], counts.reshape(n_positions, top_k)[counted], shard.global_vocab
        )
    normalizer = teacher.proposal_log_normalizer
    weights = sampled_target_weights(
        counts.detach().reshape(n_positions, top_k),
        teacher.logprobs.detach().reshape(n_positions, top_k),
        proposal_temperature=teacher.proposal_temperature,
        proposal_log_normalizer=None if normalizer is None else normalizer.reshape(n_positions),
    )
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
    lp = teacher.logprobs.detach().reshape(n_positions, top_k).to(weights.dtype)
    gap = torch.where(present, lp - log_weights, 0.0)
    offset = (torch.where(present, weights, 0.0) * gap).sum(-1)
    return TeacherRows(ids, log_weights, counted, present, offset)
