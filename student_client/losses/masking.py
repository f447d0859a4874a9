"""Which positions count, and how per-position values become a loss and batch means.

All masking of the loss package lives here: the bool mask of counted positions, the
neutral teacher rows put at positions that do not count, the reduction (and its
gradient, which both kernels apply themselves), the means, and the one step after
either kernel (`finish_loss`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from student_client.losses.support import TeacherRows
from student_client.losses.types import (
    STAT_FIELDS,
    KernelResult,
    Reduction,
    RowTerms,
    TopKKLStats,
)

__all__ = [
    "counted_positions",
    "counted_rows",
    "finish_loss",
    "masked_mean",
    "neutralize_uncounted",
    "position_count",
    "reduce_positions",
    "reduction_gradient",
    "summarize",
]


def counted_positions(
    mask: Tensor | None,
    n_positions: int,
    device: torch.device,
    teacher_logprobs: Tensor | None = None,
) -> Tensor:
    """Flat bool mask `[N]` of the positions that count (`mask` None: all of them).

    `mask` has the positions' shape `[...]` (validated by the caller), bool or 0/1. A
    position whose teacher row `teacher_logprobs` `[N, K]` is all NaN never counts: the
    teacher has no distribution there (a student tokenizer's masked row, a prefix that
    ends inside a teacher token: docs/cross_tokenizer.md). No host sync.
    """
    if mask is None:
        counted = torch.ones(n_positions, dtype=torch.bool, device=device)
    else:
        counted = mask.reshape(n_positions).to(device=device, dtype=torch.bool)
    if teacher_logprobs is not None:
        counted = counted & ~teacher_logprobs.isnan().all(dim=-1).to(device)
    return counted


def neutralize_uncounted(
    teacher_ids: Tensor, teacher_logprobs: Tensor, counted: Tensor
) -> tuple[Tensor, Tensor]:
    """Replace the teacher rows of positions that do not count by a harmless placeholder.

    Padding positions may hold anything (zeros, repeated ids); they are not validated, so
    they are replaced by distinct in-range ids `0..K-1` with log-prob `-inf` (probability 0),
    which keeps every per-position term finite. Their loss is masked out afterwards.

    Args:
        teacher_ids: `[N, K]`; requires `K <= V` (checked by the caller).
        teacher_logprobs: `[N, K]`.
        counted: bool `[N]`.

    Returns:
        `(teacher_ids, teacher_logprobs)`, `[N, K]` each. No host sync (always two `where`s).
    """
    keep = counted.unsqueeze(-1)
    top_k = teacher_ids.shape[-1]
    placeholder_ids = torch.arange(top_k, device=teacher_ids.device, dtype=teacher_ids.dtype)
    ids = torch.where(keep, teacher_ids, placeholder_ids)
    impossible = torch.full((), float("-inf"), dtype=teacher_logprobs.dtype, device=keep.device)
    return ids, torch.where(keep, teacher_logprobs, impossible)


def counted_rows(
    teacher_ids: Tensor, teacher_logprobs: Tensor, mask: Tensor | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """The positions that count and the teacher rows the kernels see: `(counted` bool
    `[N]` (:func:`counted_positions`), `ids`, `logprobs` `[N, K])` with placeholders where
    a position does not count (:func:`neutralize_uncounted`; the counted rows as given)."""
    counted = counted_positions(mask, teacher_ids.shape[0], device, teacher_logprobs)
    ids, logprobs = neutralize_uncounted(teacher_ids, teacher_logprobs, counted)
    return counted, ids, logprobs


def _zero_uncounted(values: Tensor, counted: Tensor) -> Tensor:
    """`values` `[N]` with positions that do not count set to 0 (gradient 0 there too)."""
    return torch.where(counted, values, torch.zeros((), dtype=values.dtype, device=values.device))


def position_count(counted: Tensor) -> Tensor:
    """The divisor of "mean": how many positions count (bool `[N]`), at least 1 (0-dim, no sync)."""
    return counted.sum().clamp_min(1)


def reduce_positions(
    per_position: Tensor, counted: Tensor, reduction: Reduction, positions_shape: torch.Size
) -> Tensor:
    """Reduce the per-position loss `[N]` over the counted positions.

    Returns a scalar for "mean" (0 when nothing counts, never NaN) and "sum", and
    `positions_shape` `[...]` with zeros at positions that do not count for "none".
    Its gradient w.r.t. each row is `reduction_gradient`'s.
    """
    values = _zero_uncounted(per_position, counted)
    if reduction == "none":
        return values.reshape(positions_shape)
    total = values.sum()
    if reduction == "sum":
        return total
    return total / position_count(counted).to(total.dtype)


def reduction_gradient(
    upstream: Tensor, counted: Tensor, clamped: Tensor, divisor: Tensor, reduction: Reduction
) -> Tensor:
    """The upstream gradient of each row's loss before the clamp, `[n]`: the backward of
    `reduce_positions` after the clamp, for the kernels that compute their gradient
    themselves.

    Args:
        upstream: the gradient of the reduced loss: a scalar ("mean" / "sum") or `[n]`
            ("none").
        counted, clamped: bool `[n]`; a row that does not count or was clamped gets 0.
        divisor: `position_count` of the whole call (read for "mean").
        reduction: as in `LossOptions`.
    """
    kept = counted & ~clamped
    scale = torch.where(kept, upstream, torch.zeros((), dtype=upstream.dtype))
    if reduction == "mean":
        scale = scale / divisor.to(scale.dtype)
    return scale


def masked_mean(values: Tensor, counted: Tensor) -> Tensor:
    """Means over the counted positions of each column of `values` `[N, C]` -> `[C]` (0 if none)."""
    kept = _zero_uncounted(values, counted.unsqueeze(-1))
    return kept.sum(0) / position_count(counted).to(kept.dtype)


def finish_loss(
    result: KernelResult,
    teacher: TeacherRows,
    *,
    reduction: Reduction,
    positions_shape: torch.Size,
    overlap: bool,
) -> tuple[Tensor, TopKKLStats]:
    """The step after either kernel, the same for both: the loss in the positions' shape
    ("none"), the teacher's per-row offset (a sampled teacher's loss value) added, and the
    statistics.

    Args:
        result: the kernel's `KernelResult` (its loss clamped and reduced, its rows `[N]`).
        teacher: the `TeacherRows` the kernel ran on (its `counted`, its `offset`).
        reduction, positions_shape, overlap: as in `LossOptions`, the positions' shape.
    """
    rows = result.rows
    per_position = rows.loss
    loss = result.loss.reshape(positions_shape) if reduction == "none" else result.loss
    if teacher.offset is not None:
        offset = teacher.offset.to(per_position.dtype)
        per_position = per_position + offset
        loss = loss + reduce_positions(offset, teacher.counted, reduction, positions_shape)
    stats = summarize(rows, per_position, result.clamped, teacher.counted, overlap=overlap)
    return loss, stats


def summarize(
    rows: RowTerms, per_position: Tensor, clamped: Tensor, counted: Tensor, *, overlap: bool
) -> TopKKLStats:
    """Lazy means over the counted positions of the `[N]` per-position values (no sync).

    `overlap` False: the overlap statistic was not computed and reads as NaN.
    """
    columns = [
        per_position,
        rows.head,
        rows.tail,
        rows.teacher_mass,
        rows.student_mass,
        rows.overlap if overlap else torch.zeros_like(per_position),
        clamped.to(per_position.dtype),
    ]
    means = masked_mean(torch.stack(columns, dim=-1), counted)
    if not overlap:
        means[STAT_FIELDS.index("overlap")] = math.nan
    return TopKKLStats.lazy(means, counted.sum())
