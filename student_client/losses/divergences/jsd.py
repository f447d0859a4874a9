"""Generalized Jensen-Shannon divergence `JSD(beta)` (GKD, Agarwal et al. 2024; TRL's
`GKDTrainer.generalized_jsd_loss`), with the mixture `m̂ = beta p̂ + (1 - beta) q̂`:

    JSD(beta) = beta KL(p̂ || m̂) + (1 - beta) KL(q̂ || m̂)

`beta` interpolates: near 0 it behaves as `beta KL(p̂ || q̂)` (forward), near 1 as
`(1 - beta) KL(q̂ || p̂)` (reverse); at the endpoints themselves the mixture collapses and
JSD would be 0, so, as TRL does, `beta = 0` *is* the forward KL and `beta = 1` the reverse
KL. `dJSD/dq̂_c = (1 - beta) log(q̂_c / m̂_c)` (the two `1/m̂` terms cancel), hence
`h_c = (1 - beta) q̂_c log(q̂_c / m̂_c)`. Finite wherever `q̂ > 0`: no floor needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from student_client.losses.divergences.forward_kl import ForwardKL
from student_client.losses.divergences.interface import CoarseRows
from student_client.losses.divergences.reverse_kl import ReverseKL

__all__ = ["GeneralizedJSD"]


@dataclass(frozen=True)
class GeneralizedJSD:
    """`JSD(beta)` over the categories; `beta` in [0, 1] (default 0.5, TRL's default)."""

    beta: float = 0.5
    name: ClassVar[str] = "jsd"
    truncatable: ClassVar[bool] = False

    def __post_init__(self) -> None:
        beta = self.beta
        if not isinstance(beta, int | float) or isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta: must be a number in [0, 1], got {beta!r}")

    def terms(self, rows: CoarseRows) -> tuple[Tensor, Tensor]:
        if self.beta == 0.0:
            return ForwardKL().terms(rows)
        if self.beta == 1.0:
            return ReverseKL().terms(rows)
        beta = self.beta
        p, q = rows.teacher_probs, rows.student_probs
        mixture = beta * p + (1.0 - beta) * q
        teacher_side = torch.xlogy(p, p) - torch.xlogy(p, mixture)
        student_side = q * rows.student_logprobs - torch.xlogy(q, mixture)
        return beta * teacher_side + (1.0 - beta) * student_side, (1.0 - beta) * student_side
