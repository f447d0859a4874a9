"""`topk_kl_loss` and `fused_topk_kl_loss`: validation, masking, clamping, reduction, stats
around the chunked and the fused kernels."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from student_client.losses.chunked import (
    ChunkedSettings,
    chunked_topk_kl_rows,
    localized_columns,
    statistics_dtype,
)
from student_client.losses.fused import FusedLinearTopKKLFunction, FusedSettings
from student_client.losses.masking import prepare_teacher_rows, reduce_positions, summarize
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.sizing import auto_chunk_rows, fused_chunks
from student_client.losses.support import support_columns
from student_client.losses.types import LossMode, RowTerms, TopKKLStats
from student_client.losses.validation import (
    check_candidates,
    check_linear,
    check_sampled,
    check_tensors,
)

__all__ = ["fused_topk_kl_loss", "topk_kl_loss"]


def topk_kl_loss(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mode: LossMode | None = None,
    mask: Tensor | None = None,
    *,
    options: LossOptions | None = None,
    sampled_ids: Tensor | None = None,
    sampled_logprobs: Tensor | None = None,
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
    **overrides: Any,
) -> tuple[Tensor, TopKKLStats]:
    """Distillation loss of student logits against a teacher's top-k log-probs.

    Per position (docs/losses.md), with `q = softmax(z / T)`, teacher top-k set `I`,
    `p_i = exp(l_i)`, `P = sum_I p_i`, `Q = sum_I q_i`, the loss is a divergence between
    coarse-grained distributions (`options.divergence`: forward KL by default, reverse KL,
    generalized JSD):

    - "tail" (K+1 categories, the top-k and the tail with masses `1-P`, `1-Q`): forward
      KL `sum_I p_i (log p_i - log q_i) + (1-P) log((1-P)/(1-Q))`. Non-negative, a lower
      bound of the full divergence, equal to it when K = V. `1-P` is clamped at 0 and
      `1-Q` at `tail_mass_eps` (below it the tail term is constant, no gradient).
    - "truncated" (forward KL only; verl `forward_kl_topk`): `sum_I p_i (log p_i - log
      q_i)`. Not a KL: negative when `Q > P`. `clamp_min` clamps it like verl does.
    - "tail_actual" (K+2): as "tail", with the actual next token `y` (`sampled_ids`, its
      teacher log-prob `sampled_logprobs`) in a category of its own where it is outside
      `I` (elsewhere, and where its log-prob is NaN, K+1 as "tail").

    `options.support` chooses `I` (docs/losses.md, "Supports"): "teacher" (the default,
    the teacher's top-k), "student" (the candidates: `candidate_ids` with the teacher's
    `candidate_logprobs`) or "union" (the top-k and the candidates, each id once); the
    formulas above hold with `P`, `Q` the masses on `I`. In mode "tail_actual" the actual
    token gets its own category where it is outside `I`.

    The temperature applies to the student only, and the loss is not multiplied by
    `T**2`. No gradient flows to the teacher tensors. The loss runs row chunk by row chunk
    (`chunked.py`): peak extra memory is about one gradient-sized buffer in the logits'
    dtype plus one fp32 `[chunk, V_local]` block.

    Args:
        logits: student logits `[..., V_local]`: float32, bfloat16, float16 (float64 for
            checks). Leading dims that cannot be flattened without a copy (e.g. a strided
            slice) are copied once; pass contiguous logits.
        teacher_ids: `[..., K]` global vocabulary ids, any integer dtype, distinct within a
            position (a repeated id is a ValueError), `K <= V_local * world_size`.
        teacher_logprobs: `[..., K]` teacher log-probs, any float dtype, `<= 0` (up to
            1e-3 of rounding), no NaN (`-inf` allowed).
        mode: overrides `options.mode` ("tail", "truncated", "tail_actual").
        mask: `[...]` bool or 0/1: positions that count. Teacher rows of positions that do
            not count are ignored (not validated).
        options: a `LossOptions` (default `LossOptions()`): divergence, mode, reduction,
            chunk size, temperature, guards, process group, validate, overlap.
        sampled_ids: mode "tail_actual" only: `[...]` the actual next token of each
            position (`input_ids[:, t + 1]`; any id where there is none).
        sampled_logprobs: mode "tail_actual" only: `[...]` the teacher's log-prob of it
            (the payload's `sampled_logprobs`, NaN at a sequence's last position).
        candidate_ids: supports "student" / "union" only: `[..., C]` global ids the
            student names per position (any integer dtype; -1 pads a row; a repeated id,
            or one among the teacher's top-k, counts once).
        candidate_logprobs: supports "student" / "union" only: `[..., C]` the teacher's
            log-probs at `candidate_ids` (the payload's `candidate_logprobs`, any float
            dtype; NaN where the id is -1).
        **overrides: fields of `LossOptions` (`reduction="sum"`, `temperature=2.0`, ...),
            replacing those of `options`. Under `process_group` every rank passes the same
            teacher tensors and mask and gets the same loss and stats; the gradient it gets
            is that of its own shard. With `validate=False` the call never waits for the
            device (invalid values then give undefined results instead of an error).

    Returns:
        `(loss, stats)`: `loss` a scalar (or `[...]` for "none") in float32 (float64 for
        float64 logits), differentiable w.r.t. `logits`; `stats` a `TopKKLStats`, lazy:
        its numbers are copied to the host when first read.

    Raises:
        ValueError: naming the argument, for any invalid input.
    """
    opts = LossOptions.build(options, mode=mode, **overrides)
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    shard = VocabShard.from_group(opts.process_group, logits.shape[-1] if logits.dim() else 0)
    check_tensors(logits, teacher_ids, teacher_logprobs, mask, global_vocab=shard.global_vocab)
    rows = _loss_columns(
        logits,
        (teacher_ids, teacher_logprobs),
        mask,
        (sampled_ids, sampled_logprobs),
        (candidate_ids, candidate_logprobs),
        opts,
        shard,
    )
    return chunked_loss(logits, rows, opts, shard)


class TeacherRows(NamedTuple):
    """Prepared columns of the flat positions: `ids` `[N, M]` global ids, `logprobs`
    `[N, M]` (the target's log-weights), `counted` bool `[N]`, `present` bool `[N, M]` or
    None (all), `offset` `[N]` or None: a constant (no gradient) added to each position's
    loss value, and `teacher_columns`: how many leading columns are the teacher's top-k
    (the overlap statistic's; None: all of them)."""

    ids: Tensor
    logprobs: Tensor
    counted: Tensor
    present: Tensor | None
    offset: Tensor | None = None
    teacher_columns: int | None = None


def chunked_loss(
    logits: Tensor, teacher: TeacherRows, opts: LossOptions, shard: VocabShard
) -> tuple[Tensor, TopKKLStats]:
    """The chunked kernel, clamping, reduction and statistics of validated inputs
    (`logits` `[..., V_local]`); shared by `topk_kl_loss` and the sampled loss."""
    positions_shape = logits.shape[:-1]
    local_vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, local_vocab)
    chunk_rows = opts.chunk_size if opts.chunk_size is not None else auto_chunk_rows(local_vocab)
    settings = _chunked_settings(opts, shard, chunk_rows, teacher.teacher_columns)
    rows = chunked_topk_kl_rows(
        flat_logits, teacher.ids, teacher.logprobs, settings, teacher.present
    )

    per_position = rows.loss
    clamped = torch.zeros_like(per_position, dtype=torch.bool)
    if opts.clamp_min is not None:
        clamped = per_position.detach() < opts.clamp_min
        per_position = per_position.clamp_min(opts.clamp_min)
    if teacher.offset is not None:
        per_position = per_position + teacher.offset.to(per_position.dtype)

    loss = reduce_positions(per_position, teacher.counted, opts.reduction, positions_shape)
    stats = summarize(rows, per_position.detach(), clamped, teacher.counted, overlap=opts.overlap)
    return loss, stats


def fused_topk_kl_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    mode: LossMode | None = None,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    options: LossOptions | None = None,
    sampled_ids: Tensor | None = None,
    sampled_logprobs: Tensor | None = None,
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
    **overrides: Any,
) -> tuple[Tensor, TopKKLStats]:
    """`topk_kl_loss(hidden @ weight.T + bias, ...)` without ever forming the logits.

    Same math, options, validation, statistics and return value as `topk_kl_loss` (see
    there); the logits are computed chunk by chunk and multiplied straight into the
    gradients of `hidden`, `weight` and `bias` (`fused.py`).

    Args:
        hidden: last hidden states `[..., H]`: float32, bfloat16, float16 (float64 for checks).
        weight: the lm_head weight `[V_local, H]`, same dtype and device as `hidden`; under
            `process_group`, this rank's vocabulary shard (rank `r`: rows for ids
            `[r * V_local, (r + 1) * V_local)`).
        teacher_ids, teacher_logprobs, mode, mask, options, sampled_ids, sampled_logprobs,
            candidate_ids, candidate_logprobs: as in `topk_kl_loss`.
        bias: optional lm_head bias `[V_local]`.
        **overrides: fields of `LossOptions`, as in `topk_kl_loss`. Here `chunk_size` is
            the rows of one `[chunk, V_local]` logits block in the weight's dtype (None: the
            rows in six equal chunks, each block within 64 MiB - 1 GiB,
            `sizing.fused_chunks`; the loss math runs on fp32 sub-blocks of 16 MiB on CPU);
            `grad_in_forward` (default True) computes the gradients during forward for
            "mean" / "sum" (three matmuls per chunk; measured faster on CPU,
            docs/losses.md); False recomputes the chunk logits in backward (four). "none"
            always recomputes. `grad_weight_accumulation` (default "weight") says how a
            bf16 / fp16 `grad_weight` is summed over the row chunks. Under `process_group`
            every rank passes the same `hidden`, teacher tensors and mask; the gradient of
            `hidden` is already summed over the ranks (do not all-reduce it again);
            `weight.grad` / `bias.grad` are those of the rank's shard.

    Returns:
        `(loss, stats)` as `topk_kl_loss`; `loss` is differentiable w.r.t. `hidden`,
        `weight` and `bias`. With gradients computed in forward, backward scales them by
        the upstream gradient in place, so the graph cannot be backpropagated twice.

    Raises:
        ValueError: naming the argument, for any invalid input.
    """
    opts = LossOptions.build(options, mode=mode, **overrides)
    if not isinstance(hidden, Tensor):
        raise ValueError(f"hidden: must be a torch.Tensor, got {type(hidden).__name__}")
    check_linear(hidden, weight, bias)
    shard = VocabShard.from_group(opts.process_group, weight.shape[0])
    check_tensors(
        hidden,
        teacher_ids,
        teacher_logprobs,
        mask,
        global_vocab=shard.global_vocab,
        student_name="hidden",
        last_dim="H",
    )
    rows = _loss_columns(
        hidden,
        (teacher_ids, teacher_logprobs),
        mask,
        (sampled_ids, sampled_logprobs),
        (candidate_ids, candidate_logprobs),
        opts,
        shard,
    )
    return fused_loss(hidden, weight, bias, rows, opts, shard)


def fused_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows_in: TeacherRows,
    opts: LossOptions,
    shard: VocabShard,
) -> tuple[Tensor, TopKKLStats]:
    """The fused kernel, reduction and statistics of validated inputs (`hidden`
    `[..., H]`); shared by `fused_topk_kl_loss` and the sampled loss."""
    positions_shape = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    counted = rows_in.counted
    teacher = localized_columns(
        rows_in.ids, rows_in.logprobs, rows_in.present, shard, statistics_dtype(hidden.device)
    )
    chunks = fused_chunks(
        flat_hidden.shape[0], weight.shape[0], weight.element_size(), weight.device, opts.chunk_size
    )
    grad_enabled = torch.is_grad_enabled()
    settings = FusedSettings(
        loss=_chunked_settings(opts, shard, chunks.work_rows, rows_in.teacher_columns),
        chunk_rows=chunks.block_rows,
        clamp_min=opts.clamp_min,
        reduction=opts.reduction,
        grad_in_forward=opts.grad_in_forward,
        accumulation=opts.grad_weight_accumulation,
        needs_grad=(
            grad_enabled and hidden.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
        ),
    )
    outputs = FusedLinearTopKKLFunction.apply(flat_hidden, weight, bias, teacher, counted, settings)
    loss, per_position, head, tail, teacher_mass, student_mass, overlap_rows, clamped = outputs
    rows = RowTerms(per_position, head, tail, teacher_mass, student_mass, overlap_rows)
    if opts.reduction == "none":
        loss = loss.reshape(positions_shape)
    if rows_in.offset is not None:
        offset = rows_in.offset.to(per_position.dtype)
        per_position = per_position + offset
        loss = loss + reduce_positions(offset, counted, opts.reduction, positions_shape)
    stats = summarize(rows, per_position, clamped, counted, overlap=opts.overlap)
    return loss, stats


_Pair = tuple[Tensor | None, Tensor | None]
"""`(ids, logprobs)` of an optional pair of loss arguments."""


def _loss_columns(
    student: Tensor,
    teacher: tuple[Tensor, Tensor],
    mask: Tensor | None,
    actual: _Pair,
    candidates: _Pair,
    opts: LossOptions,
    shard: VocabShard,
) -> TeacherRows:
    """Check the actual-token and candidate arguments against `student` (`[..., V_local]`
    logits or `[..., H]` hidden states); the loss's columns `[N, M]` (`support.py`) and
    the counted positions `[N]`."""
    positions, device = student.shape[:-1], student.device
    check_sampled(opts.mode, *actual, positions, device)
    check_candidates(opts.support, *candidates, positions, device)
    teacher_ids, teacher_logprobs = teacher
    n_positions = student[..., 0].numel() if student.dim() else 0
    ids, logprobs, counted = prepare_teacher_rows(
        teacher_ids,
        teacher_logprobs,
        mask,
        n_positions=n_positions,
        device=student.device,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    columns = support_columns(
        ids,
        logprobs,
        counted,
        support=opts.support,
        candidates=_given(candidates),
        actual=_given(actual) if opts.mode == "tail_actual" else None,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    return TeacherRows(
        columns.ids,
        columns.logprobs,
        counted,
        columns.present,
        teacher_columns=columns.teacher_columns,
    )


def _given(pair: _Pair) -> tuple[Tensor, Tensor] | None:
    """`pair` when both are given (checked by `_loss_columns`), else None."""
    ids, logprobs = pair
    return None if ids is None or logprobs is None else (ids, logprobs)


def _chunked_settings(
    opts: LossOptions, shard: VocabShard, chunk_rows: int, teacher_columns: int | None
) -> ChunkedSettings:
    """The loss math's settings for `opts` with `chunk_rows` rows per fp32 block, the
    first `teacher_columns` columns the teacher's top-k (None: all)."""
    return ChunkedSettings(
        tail_mode=opts.mode != "truncated",
        temperature=float(opts.temperature),
        tail_mass_eps=float(opts.tail_mass_eps),
        chunk_rows=chunk_rows,
        shard=shard,
        overlap=opts.overlap,
        divergence=opts.resolved_divergence,
        actual_token=opts.mode == "tail_actual",
        teacher_columns=teacher_columns,
    )
