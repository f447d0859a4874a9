"""Shared names of the loss package: modes, reductions, per-position terms and batch stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple

from torch import Tensor

__all__ = [
    "LOSS_MODES",
    "REDUCTIONS",
    "LossMode",
    "Reduction",
    "RowTerms",
    "TopKKLStats",
]

LossMode = Literal["tail", "truncated"]
Reduction = Literal["mean", "sum", "none"]

LOSS_MODES: tuple[LossMode, ...] = ("tail", "truncated")
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")


class RowTerms(NamedTuple):
    """Per-position loss terms, all of shape `[N]` (one entry per position).

    Only `loss` carries a gradient (w.r.t. the student logits); the others are diagnostics.

    - `loss`: the per-position loss of the chosen mode, before any clamp or mask.
    - `head`: `sum_I p_i (log p_i - log q_i)`, the top-k part (the whole truncated loss).
    - `tail`: `(1-P) log((1-P)/(1-Q))`, the tail-category term of the K+1-category KL. It
      is part of `loss` in tail mode only; in truncated mode it is what the truncation drops.
    - `teacher_mass`: `P`, the teacher's probability mass on its top-k.
    - `student_mass`: `Q`, the student's probability mass on the teacher's top-k.
    - `overlap`: fraction of the teacher's top-k ids that are inside the student's top-k
      (a teacher id whose student logit ties the student's k-th largest counts as inside).
    """

    loss: Tensor
    head: Tensor
    tail: Tensor
    teacher_mass: Tensor
    student_mass: Tensor
    overlap: Tensor


@dataclass(frozen=True)
class TopKKLStats:
    """Batch statistics of one loss call, as plain Python numbers.

    Every float is a mean over the counted positions (the mask), whatever the reduction;
    when no position counts they are all 0.0 and `positions` is 0.

    - `loss`: mean per-position loss (after the optional clamp).
    - `head_loss`, `tail_loss`: means of `RowTerms.head` and `RowTerms.tail`.
    - `teacher_mass`, `student_mass`: means of `P` and `Q`.
    - `overlap`: mean fraction of the teacher's top-k inside the student's top-k.
    - `clamped_fraction`: fraction of positions whose loss was raised to `clamp_min`
      (truncated mode with `clamp_min` only; else 0.0). Those positions get no gradient.
    - `positions`: number of counted positions.
    """

    loss: float
    head_loss: float
    tail_loss: float
    teacher_mass: float
    student_mass: float
    overlap: float
    clamped_fraction: float
    positions: int

    def as_dict(self) -> dict[str, float]:
        """All fields as a flat `{name: value}` dict, e.g. for a metrics logger."""
        return {name: float(value) for name, value in asdict(self).items()}
