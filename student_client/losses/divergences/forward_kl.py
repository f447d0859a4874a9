"""Forward KL `KL(p̂ || q̂) = sum_c p̂_c (log p̂_c - log q̂_c)` (mean-seeking; verl
`forward_kl_topk` in mode "truncated"). `h_c = -p̂_c`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from student_client.losses.divergences.interface import CoarseRows

__all__ = ["ForwardKL"]


@dataclass(frozen=True)
class ForwardKL:
    """`KL(teacher || student)` over the categories."""

    name: ClassVar[str] = "forward"
    truncatable: ClassVar[bool] = True

    def terms(self, rows: CoarseRows) -> tuple[Tensor, Tensor]:
        p = rows.teacher_probs
        gap = rows.teacher_logprobs - rows.student_logprobs
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        return torch.where(p > 0, p * gap, zero), -p
