"""The fixed parameters of one kernel call: `ChunkedSettings` (the loss math, both paths)
and `FusedSettings` (the lm_head path's chunks, reduction and gradients), both built from
a checked `LossOptions` by `chunked_settings` / the lm_head path."""

from __future__ import annotations

from dataclasses import dataclass, field

from student_client.losses.divergences import Divergence
from student_client.losses.divergences.forward_kl import ForwardKL
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.types import GradAccumulation, Reduction

__all__ = ["ChunkedSettings", "FusedSettings", "chunked_settings"]


@dataclass(frozen=True)
class ChunkedSettings:
    """Fixed parameters of one chunked loss call (validated by the caller).

    `tail_mode`: the tail category counts (False: mode "truncated"); `actual_token`: the
    last teacher column is the actual token's (mode "tail_actual"); `teacher_columns`: how
    many leading columns are the teacher's top-k (the overlap statistic's; None: all the
    support's columns).
    """

    tail_mode: bool
    temperature: float
    tail_mass_eps: float
    chunk_rows: int
    shard: VocabShard
    overlap: bool = False
    divergence: Divergence = field(default_factory=ForwardKL)
    actual_token: bool = False
    teacher_columns: int | None = None

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


@dataclass(frozen=True)
class FusedSettings:
    """Fixed parameters of one fused call (validated by the caller).

    - `loss`: the loss math's settings; its `chunk_rows` is the fp32 sub-block's rows.
    - `chunk_rows`: rows per chunk (one logits block, one pass of the three matmuls).
    - `clamp_min`, `reduction`: as in `topk_kl_loss`.
    - `grad_in_forward`: compute the gradients in forward (reductions "mean" / "sum").
    - `needs_grad`: which of hidden, weight, bias need a gradient.
    """

    loss: ChunkedSettings
    chunk_rows: int
    clamp_min: float | None
    reduction: Reduction
    grad_in_forward: bool
    needs_grad: tuple[bool, bool, bool]
    accumulation: GradAccumulation = "weight"


def chunked_settings(
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
