"""`TopKKLLoss`: an `nn.Module` holding a `LossOptions` for `topk_kl_loss`."""

from __future__ import annotations

from torch import Tensor, nn

from student_client.losses.options import LossOptions, loss_options
from student_client.losses.teacher import TeacherTargets
from student_client.losses.topk_kl import topk_kl_loss
from student_client.losses.types import TopKKLStats

__all__ = ["TopKKLLoss"]


class TopKKLLoss(nn.Module):
    """Top-k distillation loss as a module; see `topk_kl_loss` for the math and arguments.

    `TopKKLLoss(options=None)`: `options` a `LossOptions`, checked once, at construction,
    and kept as `self.options`.

    `forward(logits [..., V_local], teacher: TeacherTargets) -> (loss, stats)`.

    Example:
        >>> import torch
        >>> from student_client.losses import LossOptions, TeacherTargets, TopKKLLoss
        >>> criterion = TopKKLLoss(LossOptions(mode="truncated"))
        >>> logits = torch.zeros(2, 3, 10, requires_grad=True)  # [B, T, V]
        >>> teacher = TeacherTargets(  # the teacher's top-2 at each of 2 x 3 positions
        ...     ids=torch.tensor([0, 1]).repeat(2, 3, 1),
        ...     logprobs=torch.tensor([0.5, 0.25]).log().repeat(2, 3, 1),
        ... )
        >>> loss, stats = criterion(logits, teacher)
        >>> round(loss.item(), 4), round(stats.tail_loss, 4)  # the tail term left out
        (1.0338, -0.2908)
    """

    def __init__(self, options: LossOptions | None = None) -> None:
        super().__init__()
        self.options = loss_options(options)

    def forward(self, logits: Tensor, teacher: TeacherTargets) -> tuple[Tensor, TopKKLStats]:
        return topk_kl_loss(logits, teacher, self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in vars(self.options).items())
