"""`TopKKLLoss`: an `nn.Module` holding the options of `topk_kl_loss`."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from student_client.losses.api import topk_kl_loss
from student_client.losses.types import LossMode, Reduction, TopKKLStats
from student_client.losses.validation import check_options

__all__ = ["TopKKLLoss"]


class TopKKLLoss(nn.Module):
    """Top-k distillation loss as a module; see `topk_kl_loss` for the math and arguments.

    `forward(logits [..., V_local], teacher_ids [..., K], teacher_logprobs [..., K],
    mask [...] | None) -> (loss, stats)`. Options are checked once, at construction.
    """

    def __init__(
        self,
        mode: LossMode = "tail",
        *,
        reduction: Reduction = "mean",
        chunk_size: int | None = None,
        temperature: float = 1.0,
        tail_mass_eps: float = 1e-6,
        clamp_min: float | None = None,
        process_group: Any = None,
        validate: bool = True,
        overlap: bool = False,
    ) -> None:
        super().__init__()
        check_options(
            mode=mode,
            reduction=reduction,
            chunk_size=chunk_size,
            temperature=temperature,
            tail_mass_eps=tail_mass_eps,
            clamp_min=clamp_min,
        )
        self.mode: LossMode = mode
        self.reduction: Reduction = reduction
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.tail_mass_eps = tail_mass_eps
        self.clamp_min = clamp_min
        self.process_group = process_group
        self.validate = validate
        self.overlap = overlap

    def forward(
        self,
        logits: Tensor,
        teacher_ids: Tensor,
        teacher_logprobs: Tensor,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, TopKKLStats]:
        return topk_kl_loss(
            logits,
            teacher_ids,
            teacher_logprobs,
            mode=self.mode,
            mask=mask,
            reduction=self.reduction,
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            tail_mass_eps=self.tail_mass_eps,
            clamp_min=self.clamp_min,
            process_group=self.process_group,
            validate=self.validate,
            overlap=self.overlap,
        )

    def extra_repr(self) -> str:
        return (
            f"mode={self.mode!r}, reduction={self.reduction!r}, chunk_size={self.chunk_size}, "
            f"temperature={self.temperature}, tail_mass_eps={self.tail_mass_eps}, "
            f"clamp_min={self.clamp_min}, validate={self.validate}, overlap={self.overlap}"
        )
