"""`GradientSink`: the fused loss's gradients of `hidden`, `weight` and `bias`, accumulated
chunk by chunk (docs/lm_head_loss.md, "Weight-gradient accumulation")."""

from __future__ import annotations

import torch
from torch import Tensor

from student_client.losses.kernels.chunked import chunk_bounds, working_dtype
from student_client.losses.kernels.settings import FusedSettings
from student_client.losses.kernels.split_columns import (
    add_column_sums_,
    column_entries,
    zero_columns_,
)
from student_client.losses.parallel import gather_columns
from student_client.losses.sizing import FUSED_WEIGHT_SLICE_BYTES, column_batch_entries

__all__ = ["GradientSink"]


class GradientSink:
    """Accumulates `grad_hidden`, `grad_weight`, `grad_bias` chunk by chunk.

    `grad_weight` `[V_local, H]` is a sum over the row chunks; how it is accumulated
    (`settings.accumulation`, docs/lm_head_loss.md "Weight-gradient accumulation"):

    - "weight": in the weight's dtype, `grad_weight.addmm_(G.T, h)` per chunk: the matmul
      sums the chunk in fp32 and adds the running sum before its one rounding, so the
      result is rounded once per row chunk. No memory beyond the gradient itself.
    - "compensated": the same into a second buffer in the weight's dtype that holds the
      running sum's rounding error (hi + lo, renormalized in fp32 per vocabulary slice),
      rounded once at the end: 2x the gradient's memory.
    - "float32": an fp32 accumulator; each chunk's product is a matmul in the weight's dtype
      (rounded once), upcast and added; rounded once at the end: 3x the gradient's memory
      at the end (the fp32 sum and its rounded copy).

    For an fp32 / fp64 weight the three are the same (the working dtype is the weight's).

    With a bf16 / fp16 weight, whatever the choice, the teacher columns of each chunk's `G`
    are kept in fp32 (`[N, K]`) and zeroed in the block after `grad_hidden` used it; `finish`
    adds their share in fp32 before the last rounding (`split_columns`): only the dense
    rest of the sum is rounded per chunk.
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        teacher: tuple[Tensor, Tensor | None],
        settings: FusedSettings,
    ) -> None:
        needs_hidden, needs_weight, needs_bias = settings.needs_grad
        self.weight = weight
        self.hidden = hidden
        self.shard = settings.loss.shard
        self.hidden_dtype = hidden.dtype
        work_dtype = working_dtype(weight.dtype)
        self.grad_hidden = None
        if needs_hidden:
            # Sharded: each rank holds a partial sum, all-reduced in the working dtype.
            dtype = work_dtype if self.shard.is_sharded else hidden.dtype
            self.grad_hidden = hidden.new_empty(hidden.shape, dtype=dtype)
        self.accumulation = settings.accumulation if work_dtype != weight.dtype else "weight"
        self.grad_weight = None
        self.weight_written = False
        self.compensation: Tensor | None = None
        self.slice_rows = 0
        self.slice_buffers: tuple[Tensor, Tensor] | None = None
        if needs_weight:
            dtype = work_dtype if self.accumulation == "float32" else weight.dtype
            # "weight": the first chunk writes it (no zeroing, no read of zeros).
            make = torch.empty if self.accumulation == "weight" else torch.zeros
            self.grad_weight = make(weight.shape, dtype=dtype, device=weight.device)
            if self.accumulation == "compensated":
                self.compensation = torch.zeros_like(weight)
            if self.accumulation != "weight":
                row_bytes = max(1, weight.shape[1] * weight.element_size())
                self.slice_rows = min(
                    max(1, FUSED_WEIGHT_SLICE_BYTES // row_bytes), weight.shape[0]
                )
                shape = (self.slice_rows, weight.shape[1])
                self.slice_buffers = (
                    weight.new_empty(shape, dtype=work_dtype),
                    weight.new_empty(shape, dtype=work_dtype),
                )
        self.grad_bias = None
        if needs_bias and bias is not None:
            self.grad_bias = torch.zeros(bias.shape, dtype=work_dtype, device=bias.device)
        # A low-precision grad_weight takes the teacher columns in fp32 (`split_columns`).
        self.index, self.owned = teacher
        self.teacher_grad: Tensor | None = None
        if needs_weight and weight.dtype != work_dtype:
            self.teacher_grad = torch.zeros(
                self.index.shape, dtype=work_dtype, device=weight.device
            )
        block_rows = min(settings.chunk_rows, hidden.shape[0])
        self.column_batch = column_batch_entries(
            block_rows * weight.shape[0] * weight.element_size(), weight.shape[1], weight.device
        )

    def keep_teacher_columns(self, part: slice, grad_logits: Tensor) -> None:
        """Keep the teacher columns of rows `part`'s logit gradient `[n, V_local]` (working
        dtype, before any rounding) for the fp32 share of `grad_weight`."""
        if self.teacher_grad is not None:
            owned = None if self.owned is None else self.owned[part]
            self.teacher_grad[part] = gather_columns(grad_logits, self.index[part], owned)

    def add_bias(self, grad_logits: Tensor) -> None:
        """`grad_logits` `[n, V_local]` in the working dtype (before any rounding)."""
        if self.grad_bias is not None:
            self.grad_bias.add_(grad_logits.sum(dim=0))

    def add_chunk(self, rows: slice, grad_logits: Tensor, hidden: Tensor) -> None:
        """Multiply a chunk's logit gradient `[n, V_local]` (weight dtype) into the grads."""
        if self.grad_hidden is not None:
            target = self.grad_hidden[rows]
            if target.dtype == grad_logits.dtype:
                torch.mm(grad_logits, self.weight, out=target)
            else:
                target.copy_(grad_logits @ self.weight)
        if self.grad_weight is None:
            return
        if self.teacher_grad is not None:  # their share is added in fp32 by `finish`
            zero_columns_(
                grad_logits, self.index[rows], None if self.owned is None else self.owned[rows]
            )
        if self.accumulation == "weight":
            if self.weight_written:
                self.grad_weight.addmm_(grad_logits.t(), hidden)
            else:
                torch.mm(grad_logits.t(), hidden, out=self.grad_weight)
                self.weight_written = True
            return
        assert self.slice_buffers is not None
        first, second = self.slice_buffers
        for columns in chunk_bounds(self.grad_weight.shape[0], self.slice_rows):
            size = columns.stop - columns.start
            gradient = grad_logits[:, columns].t()
            if self.compensation is None:  # "float32"
                # (Upcast first: a mixed-dtype `add_` takes torch's slow unvectorized CPU path.)
                first[:size].copy_(gradient @ hidden)  # one rounding, then exact in fp32
                self.grad_weight[columns].add_(first[:size])
                continue
            high, low = self.grad_weight[columns], self.compensation[columns]
            low.addmm_(gradient, hidden)  # lo <- round(lo + this chunk's product)
            total, rounded = first[:size], second[:size]
            total.copy_(high)
            rounded.copy_(low)
            total.add_(rounded)  # hi + lo in fp32
            high.copy_(total)  # hi <- round(hi + lo)
            rounded.copy_(high)
            total.sub_(rounded)
            low.copy_(total)  # lo <- what that rounding dropped

    def finish(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The gradients in the inputs' dtypes (`grad_hidden` summed over the vocab shards)."""
        self.slice_buffers = None
        grad_hidden = self.grad_hidden
        if grad_hidden is not None and self.shard.is_sharded:
            grad_hidden = self.shard.all_reduce_sum_(grad_hidden).to(self.hidden_dtype)
        grad_weight, compensation = self.grad_weight, self.compensation
        self.grad_weight = self.compensation = None
        if grad_weight is not None and self.accumulation == "weight" and not self.weight_written:
            grad_weight.zero_()  # no rows
        if grad_weight is not None:
            self._add_teacher_columns(grad_weight, compensation)
        if grad_weight is not None and compensation is not None:
            for columns in chunk_bounds(grad_weight.shape[0], max(1, self.slice_rows)):
                grad_weight[columns] = grad_weight[columns].float() + compensation[columns].float()
            del compensation
        if grad_weight is not None:
            grad_weight = grad_weight.to(self.weight.dtype)  # float32: the only rounding
        grad_bias = self.grad_bias
        if grad_bias is not None:
            grad_bias = grad_bias.to(self.weight.dtype)
        return grad_hidden, grad_weight, grad_bias

    def _add_teacher_columns(self, grad_weight: Tensor, compensation: Tensor | None) -> None:
        """Add the kept teacher columns' `grad_weight` share, `[V_local, H]` rows in fp32,
        to the running sum before its last rounding (`split_columns`)."""
        if self.teacher_grad is None:
            return
        entries = column_entries(self.index, self.owned, self.teacher_grad)
        self.teacher_grad = None
        add_column_sums_(grad_weight, entries, self.hidden, self.column_batch, compensation)
