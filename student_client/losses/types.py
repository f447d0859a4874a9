"""Shared names of the loss package: modes, reductions, per-position terms and batch stats."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "GRAD_ACCUMULATIONS",
    "LOSS_MODES",
    "REDUCTIONS",
    "STAT_FIELDS",
    "SUPPORTS",
    "GradAccumulation",
    "KernelResult",
    "LossMode",
    "Reduction",
    "RowTerms",
    "Support",
    "TopKKLStats",
]

LossMode = Literal["tail", "truncated", "tail_actual"]
Reduction = Literal["mean", "sum", "none"]

GradAccumulation = Literal["weight", "compensated", "float32"]
"""Fused loss: how a bf16 / fp16 `grad_weight` is summed over the row chunks."""
GRAD_ACCUMULATIONS: tuple[GradAccumulation, ...] = ("weight", "compensated", "float32")

LOSS_MODES: tuple[LossMode, ...] = ("tail", "truncated", "tail_actual")
"""K+1 categories (top-k + tail), the top-k terms alone, or K+2 (the actual next token's
own category besides the tail, where that token is outside the teacher's top-k)."""
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")

Support = Literal["teacher", "student", "union"]
SUPPORTS: tuple[Support, ...] = ("teacher", "student", "union")
"""The ids that get a category of their own (`support.py`): the teacher's top-k, the
student's candidates, or both (each id once); the rest of the vocabulary is the tail."""


class RowTerms(NamedTuple):
    """Per-position loss terms, all of shape `[N]` (one entry per position).

    Only `loss` carries a gradient (w.r.t. the student logits); the others are diagnostics.

    - `loss`: the per-position loss of the chosen mode, before any clamp or mask.
    - `head`: the divergence's terms of the support's categories (`support="teacher"`,
      the default: the teacher's top-k; forward KL: `sum_I p_i (log p_i - log q_i)`, the
      whole truncated loss).
    - `tail`: the terms of the categories outside the support: the tail (forward KL:
      `(1-P) log((1-P)/(1-Q))`) and, in mode "tail_actual", the actual token's own. It is
      part of `loss` except in truncated mode, where it is what the truncation drops.
    - `teacher_mass`: `P`, the teacher's probability mass on the support.
    - `student_mass`: `Q`, the student's probability mass on the support.
    - `overlap`: fraction of the teacher's top-k ids that are inside the student's top-k
      (a teacher id whose student logit ties the student's k-th largest counts as inside).
    """

    loss: Tensor
    head: Tensor
    tail: Tensor
    teacher_mass: Tensor
    student_mass: Tensor
    overlap: Tensor


class KernelResult(NamedTuple):
    """What either kernel (chunked or fused) returns; the step after it
    (`masking.finish_loss`) reads only this.

    - `loss`: the rows' loss, each row clamped below at `clamp_min`, reduced over the
      counted positions (`masking.reduce_positions`): a scalar, or `[N]` for "none".
      The only tensor that carries a gradient.
    - `rows`: `RowTerms` of `[N]` tensors, no gradient (`rows.loss` after the clamp,
      before the mask).
    - `clamped`: bool `[N]`, the rows the clamp changed (they get no gradient).
    """

    loss: Tensor
    rows: RowTerms
    clamped: Tensor


STAT_FIELDS: tuple[str, ...] = (
    "loss",
    "head_loss",
    "tail_loss",
    "teacher_mass",
    "student_mass",
    "overlap",
    "clamped_fraction",
)
"""Float fields of `TopKKLStats`, in order (then `positions`, an int)."""


class TopKKLStats:
    """Batch statistics of one loss call, read as plain Python numbers.

    Every float is a mean over the counted positions (the mask), whatever the reduction;
    when no position counts they are all 0.0 and `positions` is 0.

    - `loss`: mean per-position loss (after the optional clamp).
    - `head_loss`, `tail_loss`: means of `RowTerms.head` and `RowTerms.tail`.
    - `teacher_mass`, `student_mass`: means of `P` and `Q`.
    - `overlap`: mean fraction of the teacher's top-k inside the student's top-k; NaN when
      the loss was called without `overlap=True` (it costs a `topk` per block).
    - `clamped_fraction`: fraction of positions whose loss was raised to `clamp_min`
      (truncated mode with `clamp_min` only; else 0.0). Those positions get no gradient.
    - `positions`: number of counted positions.

    Lazy: the loss stores the means as one device tensor and copies them to the host (one
    sync) the first time a number is read. `tensors()` gives them without any sync, e.g. to
    log every N steps. Built from Python numbers (`TopKKLStats(loss=..., ...)`) it is
    simply those numbers.
    """

    __slots__ = ("_host", "_means", "_positions")

    def __init__(
        self,
        loss: float = 0.0,
        head_loss: float = 0.0,
        tail_loss: float = 0.0,
        teacher_mass: float = 0.0,
        student_mass: float = 0.0,
        overlap: float = 0.0,
        clamped_fraction: float = 0.0,
        positions: int = 0,
    ) -> None:
        values = (loss, head_loss, tail_loss, teacher_mass, student_mass, overlap)
        self._host: tuple[tuple[float, ...], int] | None = (
            tuple(float(v) for v in (*values, clamped_fraction)),
            int(positions),
        )
        self._means: Tensor | None = None
        self._positions: Tensor | None = None

    @classmethod
    def lazy(cls, means: Tensor, positions: Tensor) -> TopKKLStats:
        """Stats backed by device tensors: `means` `[len(STAT_FIELDS)]`, `positions` `[]`."""
        stats = cls.__new__(cls)
        stats._host = None
        stats._means = means.detach()
        stats._positions = positions.detach()
        return stats

    def _values(self) -> tuple[tuple[float, ...], int]:
        if self._host is None:
            assert self._means is not None and self._positions is not None  # set by `lazy`
            self._host = (tuple(self._means.tolist()), int(self._positions))
            self._means = self._positions = None
        return self._host

    def tensors(self) -> dict[str, Tensor]:
        """The stats as 0-d tensors on the loss's device (no host sync); `positions` int64."""
        if self._means is not None and self._positions is not None:
            means, positions = self._means, self._positions
        else:
            floats, count = self._values()
            means, positions = torch.tensor(floats), torch.tensor(count)
        named = dict(zip(STAT_FIELDS, means.unbind(), strict=True))
        return {**named, "positions": positions}

    def _field(self, index: int) -> float:
        return self._values()[0][index]

    @property
    def loss(self) -> float:
        return self._field(0)

    @property
    def head_loss(self) -> float:
        return self._field(1)

    @property
    def tail_loss(self) -> float:
        return self._field(2)

    @property
    def teacher_mass(self) -> float:
        return self._field(3)

    @property
    def student_mass(self) -> float:
        return self._field(4)

    @property
    def overlap(self) -> float:
        return self._field(5)

    @property
    def clamped_fraction(self) -> float:
        return self._field(6)

    @property
    def positions(self) -> int:
        return self._values()[1]

    def as_dict(self) -> dict[str, float]:
        """All fields as a flat `{name: value}` dict, e.g. for a metrics logger (one sync)."""
        floats, count = self._values()
        return {**dict(zip(STAT_FIELDS, floats, strict=True)), "positions": float(count)}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopKKLStats):
            return NotImplemented
        mine, theirs = self.as_dict(), other.as_dict()
        return all(
            mine[name] == theirs[name] or (math.isnan(mine[name]) and math.isnan(theirs[name]))
            for name in mine
        )

    __hash__ = None  # type: ignore[assignment]  # mutable cache, compared by value

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.as_dict().items())
        return f"TopKKLStats({fields})"
