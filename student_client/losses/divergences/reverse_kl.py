"""Reverse KL `KL(q̂ || p̂) = sum_c q̂_c (log q̂_c - log p̂_c)` (mode-seeking: the student
pays for mass where the teacher has little). `h_c = q̂_c (log q̂_c - log p̂_c + 1)`.

A category the teacher gives 0 would cost infinity: `log p̂` is floored at
`log(tail_mass_eps)` for the tail (whose teacher mass `1 - P` rounds to 0 when the top-k
mass rounds to 1) and at `LOG_PROB_FLOOR` for a named category with log-prob `-inf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from student_client.losses.divergences.interface import TAIL, CoarseRows

__all__ = ["LOG_PROB_FLOOR", "ReverseKL", "floored_teacher_logprobs"]

LOG_PROB_FLOOR = math.log(1e-30)
"""Lower bound of a named category's teacher log-prob in the reverse KL."""


def floored_teacher_logprobs(rows: CoarseRows) -> Tensor:
    """`log p̂` `[n, C]` with the tail floored at `log(eps)`, the rest at `LOG_PROB_FLOOR`."""
    floors = torch.full_like(rows.teacher_logprobs[:1], LOG_PROB_FLOOR)
    floors[:, TAIL] = math.log(rows.tail_mass_eps)
    return torch.maximum(rows.teacher_logprobs, floors)


@dataclass(frozen=True)
class ReverseKL:
    """`KL(student || teacher)` over the categories."""

    name: ClassVar[str] = "reverse"
    truncatable: ClassVar[bool] = False

    def terms(self, rows: CoarseRows) -> tuple[Tensor, Tensor]:
        q = rows.student_probs
        gap = rows.student_logprobs - floored_teacher_logprobs(rows)
        return q * gap, q * (gap + 1.0)
