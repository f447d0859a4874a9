"""The fixed parameters of one kernel call: `ChunkedSettings` (the loss math, both paths)
and `FusedSettings` (the lm_head path's chunks and gradients). Both hold the call's one
checked `LossOptions` and read every option from it; they add only what the call itself
decides (the vocabulary shard, chunk sizes, columns, which inputs need a gradient)."""

from __future__ import annotations

from dataclasses import dataclass

from student_client.losses.divergences import Divergence
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.types import GradAccumulation, Reduction

__all__ = ["ChunkedSettings", "FusedSettings"]


@dataclass(frozen=True)
class ChunkedSettings:
    """One chunked pass of the loss math: the call's checked `options` (the only copy of
    them: mode, temperature, guard, divergence and the rest are read from it), this
    rank's vocabulary `shard`, `chunk_rows` rows per fp32 block, and how many leading
    columns are the teacher's top-k (`teacher_columns`, the overlap statistic's; None: all
    the support's columns)."""

    options: LossOptions
    shard: VocabShard
    chunk_rows: int
    teacher_columns: int | None = None

    @property
    def tail_mode(self) -> bool:
        """The tail category counts (False: mode "truncated")."""
        return self.options.mode != "truncated"

    @property
    def actual_token(self) -> bool:
        """The last column is the actual token's (mode "tail_actual")."""
        return self.options.mode == "tail_actual"

    @property
    def temperature(self) -> float:
        return float(self.options.temperature)

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature

    @property
    def tail_mass_eps(self) -> float:
        return float(self.options.tail_mass_eps)

    @property
    def overlap(self) -> bool:
        return self.options.overlap

    @property
    def divergence(self) -> Divergence:
        return self.options.resolved_divergence

    @property
    def reduction(self) -> Reduction:
        """How the kernel reduces its rows' loss (`masking.reduce_positions`)."""
        return self.options.reduction

    @property
    def clamp_min(self) -> float | None:
        """Each row's loss is clamped below at this inside the kernel (no gradient
        where it is), on both paths."""
        return self.options.clamp_min


@dataclass(frozen=True)
class FusedSettings:
    """One fused call: the loss math's settings `loss` (its `chunk_rows` the fp32
    sub-block's rows; its `options` the call's, read for the clamp, the reduction and
    the gradients' handling), `chunk_rows` rows per logits block (one pass of the three
    matmuls), and which of hidden, weight, bias need a gradient (`needs_grad`)."""

    loss: ChunkedSettings
    chunk_rows: int
    needs_grad: tuple[bool, bool, bool]

    @property
    def reduction(self) -> Reduction:
        return self.loss.reduction

    @property
    def grad_in_forward(self) -> bool:
        """Compute the gradients in forward (reductions "mean" / "sum")."""
        return self.loss.options.grad_in_forward

    @property
    def accumulation(self) -> GradAccumulation:
        return self.loss.options.grad_weight_accumulation
