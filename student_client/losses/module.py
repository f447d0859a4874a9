"""`TopKKLLoss`: an `nn.Module` holding a `LossOptions` for `topk_kl_loss`."""

from __future__ import annotations

from torch import Tensor, nn

from student_client.losses.api import topk_kl_loss
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.teacher import TeacherTargets
from student_client.losses.types import TopKKLStats

__all__ = ["TopKKLLoss"]


class TopKKLLoss(nn.Module):
    """Top-k distillation loss as a module; see `topk_kl_loss` for the math and arguments.

    `TopKKLLoss(options=None)`: `options` a `LossOptions`, checked once, at construction,
    and kept as `self.options`.

    `forward(logits [..., V_local], teacher: TeacherTargets) -> (loss, stats)`.
    """

    def __init__(self, options: LossOptions | None = None) -> None:
        super().__init__()
        self.options = loss_options(options)

    def forward(self, logits: Tensor, teacher: TeacherTargets) -> tuple[Tensor, TopKKLStats]:
        return topk_kl_loss(logits, teacher, self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in vars(self.options).items())
