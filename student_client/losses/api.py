"""`topk_kl_loss` (the logits path) and `linear_topk_kl_loss` (the lm_head path's kernel):
validation, masking, clamping, reduction, stats around the chunked and the fused kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from student_client.losses.chunked import (
    ChunkedSettings,
    chunked_topk_kl_rows,
    localized_columns,
    statistics_dtype,
)
from student_client.losses.fused import FusedLinearTopKKLFunction, FusedSettings
from student_client.losses.input_checks import (
    check_candidates,
    check_linear,
    check_sampled,
    check_tensors,
)
from student_client.losses.masking import prepare_teacher_rows, reduce_positions, summarize
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.parallel import VocabShard
from student_client.losses.sampled import sampled_options, sampled_rows
from student_client.losses.sizing import auto_chunk_rows, fused_chunks
from student_client.losses.support import TeacherRows, support_columns
from student_client.losses.teacher import TeacherTargets
from student_client.losses.types import RowTerms, TopKKLStats

__all__ = ["linear_topk_kl_loss", "teacher_rows", "topk_kl_loss"]


def topk_kl_loss(
    logits: Tensor, teacher: TeacherTargets, options: LossOptions | None = None
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
        teacher: a `TeacherTargets` (`TeacherTargets.from_payload(payload, ...)`): the
            top-k `ids` `[..., K]` (global ids, distinct within a position,
            `K <= V_local * world_size`) and `logprobs` `[..., K]` (`<= 0` up to 1e-3 of
            rounding, no NaN), the `mask` `[...]` (teacher rows of positions that do not
            count are ignored, not validated), mode "tail_actual"'s `sampled_ids` /
            `sampled_logprobs` `[...]`, supports "student" / "union"'s `candidate_ids` /
            `candidate_logprobs` `[..., C]`. With `sample_counts` the loss is the sampled
            loss (`sampled.py`): the forward KL against the unbiased target of the draws.
        options: a `LossOptions` (default `LossOptions()`): divergence, mode, support,
            reduction, chunk size, temperature, guards, process group, validate,
            overlap. Under `process_group` every rank passes the same teacher value and
            gets the same loss and stats; the gradient it gets is that of its own shard.
            With `validate=False` the call never waits for the device (invalid values
            then give undefined results instead of an error).

    Returns:
        `(loss, stats)`: `loss` a scalar (or `[...]` for "none") in float32 (float64 for
        float64 logits), differentiable w.r.t. `logits`; `stats` a `TopKKLStats`, lazy:
        its numbers are copied to the host when first read.

    Raises:
        ValueError: naming the argument, for any invalid input.
    """
    opts = loss_options(options)
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    shard = VocabShard.from_group(opts.process_group, logits.shape[-1] if logits.dim() else 0)
    opts, rows = teacher_rows(logits, teacher, opts, shard, {})
    return chunked_loss(logits, rows, opts, shard)


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


def linear_topk_kl_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher: TeacherTargets,
    opts: LossOptions,
) -> tuple[Tensor, TopKKLStats]:
    """`topk_kl_loss(hidden @ weight.T + bias, teacher, opts)` without ever forming the
    logits (`fused.py`): `hidden` `[..., H]`, `weight` `[V_local, H]` (this rank's
    vocabulary shard under `process_group`), `bias` `[V_local]` or None. The lm_head
    path's kernel (`lm_head_topk_kl_loss`)."""
    if not isinstance(hidden, Tensor):
        raise ValueError(f"hidden: must be a torch.Tensor, got {type(hidden).__name__}")
    check_linear(hidden, weight, bias)
    shard = VocabShard.from_group(opts.process_group, weight.shape[0])
    opts, rows = teacher_rows(hidden, teacher, opts, shard, _HIDDEN)
    return fused_loss(hidden, weight, bias, rows, opts, shard)


_HIDDEN = {"student_name": "hidden", "last_dim": "H"}


def fused_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows_in: TeacherRows,
    opts: LossOptions,
    shard: VocabShard,
) -> tuple[Tensor, TopKKLStats]:
    """The fused kernel, reduction and statistics of validated inputs (`hidden`
    `[..., H]`) of `linear_topk_kl_loss`, top-k or sampled."""
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


def teacher_rows(
    student: Tensor,
    teacher: TeacherTargets,
    opts: LossOptions,
    shard: VocabShard,
    names: dict[str, str],
) -> tuple[LossOptions, TeacherRows]:
    """Check `teacher` against `student` (`[..., V_local]` logits or `[..., H]` hidden
    states, named by `names`); the options the kernels run with and the loss's columns
    `[N, M]` (`support.py`; a sampled teacher: `sampled.py`)."""
    if not isinstance(teacher, TeacherTargets):
        raise ValueError(
            f"teacher: must be a TeacherTargets (TeacherTargets.from_payload(payload)), "
            f"got {type(teacher).__name__}"
        )
    if teacher.is_sampled:
        opts = sampled_options(opts)
    check_tensors(
        student,
        teacher.ids,
        teacher.logprobs,
        teacher.mask,
        global_vocab=shard.global_vocab,
        **names,
    )
    if teacher.is_sampled:
        return opts, sampled_rows(student, teacher, opts, shard)
    positions, device = student.shape[:-1], student.device
    check_sampled(opts.mode, teacher.sampled_ids, teacher.sampled_logprobs, positions, device)
    check_candidates(
        opts.support, teacher.candidate_ids, teacher.candidate_logprobs, positions, device
    )
    n_positions = student[..., 0].numel() if student.dim() else 0
    ids, logprobs, counted = prepare_teacher_rows(
        teacher.ids,
        teacher.logprobs,
        teacher.mask,
        n_positions=n_positions,
        device=student.device,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    candidates = None
    if opts.support != "teacher":
        assert teacher.candidate_ids is not None and teacher.candidate_logprobs is not None
        candidates = (teacher.candidate_ids, teacher.candidate_logprobs)
    actual = None
    if opts.mode == "tail_actual":
        assert teacher.sampled_ids is not None and teacher.sampled_logprobs is not None
        actual = (teacher.sampled_ids, teacher.sampled_logprobs)
    rows = support_columns(
        ids,
        logprobs,
        counted,
        support=opts.support,
        candidates=candidates,
        actual=actual,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    return opts, rows


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
