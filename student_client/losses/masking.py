"""Which positions count, and how per-position values become a loss and batch means.

All masking of the loss package lives here: the bool mask of counted positions, the
neutral teacher rows put at positions that do not count, the reduction and the means.
"""

from __future__ import annotations

import torch
from torch import Tensor

from student_client.losses.types import Reduction

__all__ = ["counted_positions", "masked_mean", "neutralize_uncounted", "reduce_positions"]


def counted_positions(mask: Tensor | None, n_positions: int, device: torch.device) -> Tensor:
    """Flat bool mask `[N]` of the positions that count (`mask` None: all of them).

    `mask` has the positions' shape `[...]` (validated by the caller), bool or 0/1.
    """
    if mask is None:
        return torch.ones(n_positions, dtype=torch.bool, device=device)
    return mask.reshape(n_positions).to(device=device, dtype=torch.bool)


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
        `(teacher_ids, teacher_logprobs)`, `[N, K]` each (the inputs when all positions count).
    """
    if bool(counted.all()):
        return teacher_ids, teacher_logprobs
    keep = counted.unsqueeze(-1)
    top_k = teacher_ids.shape[-1]
    placeholder_ids = torch.arange(top_k, device=teacher_ids.device, dtype=teacher_ids.dtype)
    ids = torch.where(keep, teacher_ids, placeholder_ids)
    impossible = torch.full((), float("-inf"), dtype=teacher_logprobs.dtype, device=keep.device)
    return ids, torch.where(keep, teacher_logprobs, impossible)


def _zero_uncounted(values: Tensor, counted: Tensor) -> Tensor:
    """`values` `[N]` with positions that do not count set to 0 (gradient 0 there too)."""
    return torch.where(counted, values, torch.zeros((), dtype=values.dtype, device=values.device))


def reduce_positions(
    per_position: Tensor, counted: Tensor, reduction: Reduction, positions_shape: torch.Size
) -> Tensor:
    """Reduce the per-position loss `[N]` over the counted positions.

    Returns a scalar for "mean" (0 when nothing counts, never NaN) and "sum", and
    `positions_shape` `[...]` with zeros at positions that do not count for "none".
    """
    values = _zero_uncounted(per_position, counted)
    if reduction == "none":
        return values.reshape(positions_shape)
    total = values.sum()
    if reduction == "sum":
        return total
    return total / counted.sum().clamp_min(1).to(total.dtype)


def masked_mean(values: Tensor, counted: Tensor) -> Tensor:
    """Means over the counted positions of each column of `values` `[N, C]` -> `[C]` (0 if none)."""
    kept = _zero_uncounted(values, counted.unsqueeze(-1))
    return kept.sum(0) / counted.sum().clamp_min(1).to(kept.dtype)
