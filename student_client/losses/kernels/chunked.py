"""Chunked top-k KL: a custom autograd function that never materializes `[N, V]` in fp32.

Forward walks row chunks: each `[chunk, V_local]` block of logits is copied into one reused
fp32 work buffer, centred on the row max, and reduced to a few numbers per row (see
`functional.VocabReductions`). It saves only the logits (their own dtype) and per-row fp32
statistics (`[N]`, plus the teacher's `[N, K]`). Backward walks the same chunks, rebuilds
`exp(s - max)` from the saved row max (never from a rounded log-sum-exp, so a common offset
of the logits changes nothing), and writes the analytic gradient chunk by chunk into one
buffer of the logits' dtype. No autograd graph is built through `[N, V]`.

Peak extra memory: the gradient buffer (1x the logits) plus one fp32 chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from student_client.losses.kernels.functional import (
    GradientCoefficients,
    TeacherMass,
    VocabReductions,
    row_terms,
    teacher_column_gradient,
    teacher_mass,
)
from student_client.losses.kernels.settings import ChunkedSettings
from student_client.losses.masking import position_count, reduce_positions, reduction_gradient
from student_client.losses.parallel import VocabShard, gather_columns, put_columns
from student_client.losses.types import KernelResult, RowTerms

# What users call lives in `sizing.py` (chunk sizes) and `topk_kl.py`; everything here (the
# autograd function, the per-chunk kernels that `fused.py` and the entry points import by name)
# is this package's internals.
__all__: list[str] = []


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the math runs in: float64 for float64 logits, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def statistics_dtype(device: torch.device) -> torch.dtype:
    """Dtype of the per-position `[N]` / `[N, K]` math: float64 (float32 on MPS, which has none)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass(frozen=True)
class TeacherColumns:
    """The loss's columns (`support.py`) as seen from one vocab shard.

    - `index`: local column of each id, `[N, K']` int64 (0 where not owned).
    - `owned`: bool `[N, K']`, the categories held by this shard (None: all of them).
    - `logprobs`: `[N, K']` in the statistics dtype (`statistics_dtype`).
    - `present`: bool `[N, K']`, the columns that are categories on any shard (None: all).
    """

    index: Tensor
    owned: Tensor | None
    logprobs: Tensor
    present: Tensor | None = None

    def rows(self, rows: slice) -> TeacherColumns:
        """The same columns for a slice of rows."""
        owned = None if self.owned is None else self.owned[rows]
        present = None if self.present is None else self.present[rows]
        return TeacherColumns(self.index[rows], owned, self.logprobs[rows], present)


class ChunkPass(NamedTuple):
    """What `reduce_chunk` leaves for a chunk of `n` rows.

    - `row_max`: global row max of the raw logits, `[n]`.
    - `reductions`: the vocabulary reductions summed over every shard (working dtype).
    - `exp_teacher`: this shard's `exp(s_i)` at the teacher's ids, `[n, K]` (0 where not owned).
    """

    row_max: Tensor
    reductions: VocabReductions
    exp_teacher: Tensor


def center_(work: Tensor, row_max: Tensor, inv_temperature: float) -> None:
    """In place: `work` `[n, V_local]` <- `(work - row_max) / T`, `row_max` `[n]`."""
    work.sub_(row_max.unsqueeze(1))
    if inv_temperature != 1.0:
        work.mul_(inv_temperature)


def reduce_chunk(
    chunk: Tensor,
    work: Tensor,
    teacher: TeacherColumns,
    settings: ChunkedSettings,
) -> ChunkPass:
    """One row chunk's pass over the vocabulary (three collectives when sharded).

    Args:
        chunk: student logits of the chunk, `[n, V_local]`, any float dtype (may be `work`
            itself, then nothing is copied).
        work: scratch buffer `[n, V_local]` in the working dtype. On return it holds
            `exp(s - max)` with the teacher's owned columns set to 0.
        teacher: the teacher columns of the chunk's rows (`[n, K]`).
        settings: loss parameters and the vocab shard.
    """
    shard = settings.shard
    top_k = settings.teacher_columns
    if top_k is None:
        top_k = teacher.index.shape[1]
    work.copy_(chunk)
    row_max = shard.all_reduce_max_(work.amax(dim=1))
    center_(work, row_max, settings.inv_temperature)

    teacher_logits = gather_columns(work, teacher.index, teacher.owned)
    local_top = None
    if settings.overlap and top_k > 0:
        local_top = torch.topk(work, min(top_k, work.shape[1]), dim=1, sorted=False).values

    work.exp_()
    exp_inside = gather_columns(work, teacher.index, teacher.owned)
    put_columns(work, teacher.index, teacher.owned, torch.zeros_like(exp_inside))
    packed = torch.cat(
        [work.sum(dim=1, keepdim=True), exp_inside.sum(dim=1, keepdim=True), teacher_logits],
        dim=1,
    )
    shard.all_reduce_sum_(packed)

    kth_largest = None
    if local_top is not None:
        candidates = shard.all_gather_columns(local_top)
        if candidates.shape[1] > top_k:
            candidates = torch.topk(candidates, top_k, dim=1, sorted=False).values
        kth_largest = candidates.amin(dim=1)
    reductions = VocabReductions(
        sum_outside=packed[:, 0],
        sum_inside=packed[:, 1],
        teacher_logits=packed[:, 2:],
        kth_largest=kth_largest,
    )
    return ChunkPass(row_max=row_max, reductions=reductions, exp_teacher=exp_inside)


def terms_from_reductions(
    teacher_logprobs: Tensor,
    reductions: VocabReductions,
    settings: ChunkedSettings,
    masses: TeacherMass | None = None,
    present: Tensor | None = None,
) -> tuple[RowTerms, GradientCoefficients, Tensor]:
    """Per-position terms of rows whose vocabulary pass is done.

    Args:
        teacher_logprobs: `[n, K']` in the statistics dtype (`statistics_dtype`).
        present: bool `[n, K']`, the columns that are categories (None: all).
        reductions: `[n]` / `[n, K']` reductions in the working dtype.
        settings: mode, divergence and tail guard.
        masses: `teacher_mass(teacher_logprobs)` if already computed.

    Returns:
        `(terms, coefficients, pull)`, all in the statistics dtype: the per-row `RowTerms`,
        the gradient coefficients and the teacher columns' `pull` `[n, K']`
        (`functional.row_terms`; the forward KL's is `p_i`).

    The per-position math works on `[n]` / `[n, K]` values only, so it runs in float64
    (cheap): the cancellations in `log p - log q` and in `1 - P` at large K then cost no
    fp32 digits. It is per row, so any split of the rows gives the same values.
    """
    stats_dtype = teacher_logprobs.dtype
    kth_largest = reductions.kth_largest
    converted = VocabReductions(
        sum_outside=reductions.sum_outside.to(stats_dtype),
        sum_inside=reductions.sum_inside.to(stats_dtype),
        teacher_logits=reductions.teacher_logits.to(stats_dtype),
        kth_largest=None if kth_largest is None else kth_largest.to(stats_dtype),
    )
    if masses is None:
        masses = teacher_mass(teacher_logprobs)
    return row_terms(
        teacher_logprobs,
        masses,
        converted,
        tail_mode=settings.tail_mode,
        tail_mass_eps=settings.tail_mass_eps,
        divergence=settings.divergence,
        present=present,
        actual_token=settings.actual_token,
        teacher_columns=settings.teacher_columns,
    )


def logit_gradient_(
    work: Tensor,
    exp_teacher: Tensor,
    index: Tensor,
    owned: Tensor | None,
    teacher_probs: Tensor,
    total: Tensor,
    coefficients: GradientCoefficients,
    scale: Tensor,
) -> None:
    """In place: `work` `exp(s - max)` `[n, V_local]` -> the loss's gradient w.r.t. the logits.

    Args:
        work: `exp(s - max)` of the rows (working dtype; the teacher's columns may hold
            anything, they are overwritten).
        exp_teacher: `exp(s_i - max)` at the teacher's ids, `[n, K]` (any value where not owned).
        index: local column of each teacher id, `[n, K]` int64.
        owned: bool `[n, K]`, ids held by this shard (None: all).
        teacher_probs: the teacher columns' `pull` (`row_terms`; forward KL: `p_i`), `[n, K']`,
            working dtype.
        total: `sum_j exp(s_j - max)` over the whole vocabulary, `[n]`.
        coefficients: `a`, `b` per row, `[n]` each, working dtype.
        scale: upstream gradient of each row's loss divided by `T`, `[n]`.
    """
    inv_total = total.reciprocal()
    student_probs = exp_teacher * inv_total.unsqueeze(1)
    inside = teacher_column_gradient(student_probs, teacher_probs, coefficients, scale)
    work.mul_((scale * coefficients.outside * inv_total).unsqueeze(1))
    put_columns(work, index, owned, inside)


def recompute_logit_gradient_(
    work: Tensor,
    chunk: Tensor,
    index: Tensor,
    owned: Tensor | None,
    teacher_probs: Tensor,
    row_max: Tensor,
    total: Tensor,
    coefficients: GradientCoefficients,
    scale: Tensor,
    settings: ChunkedSettings,
) -> None:
    """`work` `[n, V_local]` <- the gradient w.r.t. the logits `chunk`, from saved row stats.

    Rebuilds `exp(s - max)` from the saved row max (never from a rounded log-sum-exp), then
    `logit_gradient_`. `chunk` may be `work` itself. Arguments as in `logit_gradient_`.
    """
    work.copy_(chunk)
    center_(work, row_max, settings.inv_temperature)
    work.exp_()
    exp_teacher = gather_columns(work, index, owned)
    logit_gradient_(work, exp_teacher, index, owned, teacher_probs, total, coefficients, scale)


def chunk_bounds(n_rows: int, chunk_rows: int) -> list[slice]:
    """Row slices of at most `chunk_rows` rows covering `[0, n_rows)`."""
    return [slice(start, min(start + chunk_rows, n_rows)) for start in range(0, n_rows, chunk_rows)]


def _chunked_gradient(
    logits: Tensor,
    index: Tensor,
    owned: Tensor | None,
    teacher_probs: Tensor,
    row_max: Tensor,
    total: Tensor,
    coefficients: GradientCoefficients,
    grad_rows: Tensor,
    settings: ChunkedSettings,
) -> Tensor:
    """Analytic gradient w.r.t. the logits, written chunk by chunk.

    Args:
        logits: `[N, V_local]` saved student logits.
        index: local column of each teacher id, `[N, K]` int64.
        owned: bool `[N, K]`, ids held by this shard (None: all).
        teacher_probs: the teacher columns' `pull` (forward KL: `p_i`), `[N, K']`.
        row_max: global row max of the raw logits, `[N]`.
        total: `sum_j exp(s_j)` over the whole vocabulary, `[N]`.
        coefficients: `a`, `b` per row, `[N]` each.
        grad_rows: upstream gradient of each row's loss, `[N]`.
        settings: loss parameters and the vocab shard.

    Returns:
        `[N, V_local]` in the logits' dtype.
    """
    work_dtype = working_dtype(logits.dtype)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    in_place = grad.dtype == work_dtype
    n_rows, local_vocab = logits.shape
    buffer = None
    if not in_place:
        buffer = logits.new_empty((min(settings.chunk_rows, n_rows), local_vocab), dtype=work_dtype)
    scale = grad_rows.to(work_dtype) * settings.inv_temperature

    for rows in chunk_bounds(n_rows, settings.chunk_rows):
        target = grad[rows]
        work = target if buffer is None else buffer[: target.shape[0]]
        recompute_logit_gradient_(
            work,
            logits[rows],
            index[rows],
            None if owned is None else owned[rows],
            teacher_probs[rows],
            row_max[rows],
            total[rows],
            GradientCoefficients(
                outside=coefficients.outside[rows], inside_extra=coefficients.inside_extra[rows]
            ),
            scale[rows],
            settings,
        )
        if work is not target:
            target.copy_(work)  # the only rounding to the logits' dtype
    return grad


class ChunkedTopKKLFunction(torch.autograd.Function):
    """The chunked loss as one autograd node, with an analytic backward.

    `apply(logits [N, V_local], teacher, counted [N], settings)` returns `(loss,
    per_position, head, tail, teacher_mass, student_mass, overlap, clamped)`: `loss` the
    rows clamped below at `settings.clamp_min` and reduced over the `counted` rows as
    `settings.reduction` says (`[N]` for "none"), the rest `[N]` diagnostics
    (`per_position` after the clamp; `clamped` bool). Only `loss` is differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        teacher: TeacherColumns,
        counted: Tensor,
        settings: ChunkedSettings,
    ) -> tuple[Tensor, ...]:
        n_rows, local_vocab = logits.shape
        top_k = teacher.index.shape[1]
        work_dtype = working_dtype(logits.dtype)
        factory: dict[str, Any] = {"dtype": work_dtype, "device": logits.device}
        row_max = torch.empty(n_rows, **factory)
        sum_outside = torch.empty(n_rows, **factory)
        sum_inside = torch.empty(n_rows, **factory)
        teacher_logits = torch.empty(n_rows, top_k, **factory)
        kth_largest = torch.empty(n_rows, **factory) if settings.overlap else None
        work = torch.empty(min(settings.chunk_rows, n_rows), local_vocab, **factory)
        for rows in chunk_bounds(n_rows, settings.chunk_rows):
            chunk = logits[rows]
            chunk_pass = reduce_chunk(chunk, work[: chunk.shape[0]], teacher.rows(rows), settings)
            row_max[rows] = chunk_pass.row_max
            reduced = chunk_pass.reductions
            sum_outside[rows] = reduced.sum_outside
            sum_inside[rows] = reduced.sum_inside
            teacher_logits[rows] = reduced.teacher_logits
            if kth_largest is not None and reduced.kth_largest is not None:
                kth_largest[rows] = reduced.kth_largest

        reductions = VocabReductions(sum_outside, sum_inside, teacher_logits, kth_largest)
        terms, coefficients, teacher_probs = terms_from_reductions(
            teacher.logprobs, reductions, settings, present=teacher.present
        )
        clamped_loss, clamped = clamp_rows(terms.loss, settings.clamp_min)
        diagnostics = [term.to(work_dtype) for term in terms._replace(loss=clamped_loss)]
        per_position = diagnostics[0]
        loss = reduce_positions(per_position, counted, settings.reduction, per_position.shape)
        ctx.save_for_backward(
            logits,
            teacher.index,
            teacher.owned,
            teacher_probs.to(work_dtype),
            row_max,
            sum_outside + sum_inside,
            coefficients.outside.to(work_dtype),
            coefficients.inside_extra.to(work_dtype),
            counted,
            clamped,
        )
        ctx.settings = settings
        outputs = (loss, *diagnostics, clamped)
        ctx.mark_non_differentiable(*outputs[1:])  # only `loss` is differentiable
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_diagnostic_grads: Tensor) -> tuple[Any, ...]:
        (
            logits,
            index,
            owned,
            teacher_probs,
            row_max,
            total,
            outside,
            inside_extra,
            counted,
            clamped,
        ) = ctx.saved_tensors
        settings: ChunkedSettings = ctx.settings
        grad_logits = None
        if ctx.needs_input_grad[0]:
            grad_rows = reduction_gradient(
                grad_loss, counted, clamped, position_count(counted), settings.reduction
            )
            grad_logits = _chunked_gradient(
                logits,
                index,
                owned,
                teacher_probs,
                row_max,
                total,
                GradientCoefficients(outside=outside, inside_extra=inside_extra),
                grad_rows,
                settings,
            )
        teacher_grad = None  # the teacher's top-k is data, not a parameter
        counted_grad = None  # a mask
        settings_grad = None  # plain configuration
        return grad_logits, teacher_grad, counted_grad, settings_grad


def localized_columns(
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    present: Tensor | None,
    shard: VocabShard,
    dtype: torch.dtype,
) -> TeacherColumns:
    """The columns `[N, K']` as `shard` sees them, log-probs cast to `dtype`.

    `present` (bool `[N, K']` or None: all) marks the columns that are categories; the
    others are owned by no rank (never gathered from, never written).
    """
    index, owned = shard.localize(teacher_ids)
    if present is not None:
        owned = present if owned is None else owned & present
    return TeacherColumns(index, owned, teacher_logprobs.to(dtype), present)


def clamp_rows(loss: Tensor, clamp_min: float | None) -> tuple[Tensor, Tensor]:
    """`loss` `[n]` clamped below at `clamp_min` (None: as is), and which rows were
    (bool `[n]`; a row at the bound is not)."""
    if clamp_min is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    return loss.clamp_min(clamp_min), loss < clamp_min


def chunked_topk_kl(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    counted: Tensor,
    settings: ChunkedSettings,
    present: Tensor | None = None,
) -> KernelResult:
    """The chunked kernel on already validated inputs.

    Args:
        logits: student logits `[N, V_local]` (this rank's vocab shard), float dtype.
        teacher_ids: global ids of the columns `[N, K']` (`support.py`), integer, distinct
            within a row among the `present` columns.
        teacher_logprobs: teacher log-probs `[N, K']` (`-inf` where absent).
        counted: bool `[N]`, the rows the reduction counts.
        settings: the call's options, chunk rows and the vocab shard.
        present: bool `[N, K']`, the columns that are categories (None: all): a padded or
            repeated candidate, an actual token inside the support or unknown are absent.

    Returns:
        A `KernelResult`: the loss clamped and reduced (differentiable), the `RowTerms` of
        `[N]` tensors in the working dtype, which rows were clamped (bool `[N]`).
    """
    teacher = localized_columns(
        teacher_ids, teacher_logprobs, present, settings.shard, statistics_dtype(logits.device)
    )
    loss, *terms, clamped = ChunkedTopKKLFunction.apply(logits, teacher, counted, settings)
    return KernelResult(loss, RowTerms(*terms), clamped)
