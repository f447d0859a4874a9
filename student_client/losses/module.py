"""`TopKKLLoss`: an `nn.Module` holding a `LossOptions` for `topk_kl_loss`."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from student_client.losses.api import topk_kl_loss
from student_client.losses.options import LossOptions
from student_client.losses.types import LossMode, TopKKLStats

__all__ = ["TopKKLLoss"]


class TopKKLLoss(nn.Module):
    """Top-k distillation loss as a module; see `topk_kl_loss` for the math and arguments.

    `TopKKLLoss(mode=None, *, options=None, **overrides)`: `options` a `LossOptions`, its
    fields as keyword arguments overriding it (`TopKKLLoss("truncated", reduction="sum")`);
    checked once, at construction, and kept as `self.options`.

    `forward(logits [..., V_local], teacher_ids [..., K], teacher_logprobs [..., K],
    mask [...] | None, *, sampled_ids [...] | None, sampled_logprobs [...] | None,
    candidate_ids [..., C] | None, candidate_logprobs [..., C] | None) -> (loss, stats)`.
    """

    def __init__(
        self, mode: LossMode | None = None, *, options: LossOptions | None = None, **overrides: Any
    ) -> None:
        super().__init__()
        self.options = LossOptions.build(options, mode=mode, **overrides)

    def forward(
        self,
        logits: Tensor,
        teacher_ids: Tensor,
        teacher_logprobs: Tensor,
        mask: Tensor | None = None,
        *,
        sampled_ids: Tensor | None = None,
        sampled_logprobs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        candidate_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, TopKKLStats]:
        return topk_kl_loss(
            logits,
            teacher_ids,
            teacher_logprobs,
            mask=mask,
            options=self.options,
            sampled_ids=sampled_ids,
            sampled_logprobs=sampled_logprobs,
            candidate_ids=candidate_ids,
            candidate_logprobs=candidate_logprobs,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in vars(self.options).items())
