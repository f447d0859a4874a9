"""Pure per-position math of the top-k KL losses (docs/losses.md), on reduced statistics.

The chunked pass (`chunked.py`) walks the vocabulary once per row and reduces it to a few
numbers per position; everything here works on those `[N]` / `[N, K]` tensors only, never on
`[N, V]`. Notation per position: `s = (z - max z) / T` (the tempered logits relative to the
row max), `q = softmax(s)`; teacher top-k set `I` with `p_i = exp(l_i)`; `P = sum_I p_i`,
`Q = sum_I q_i`.

Gradient (derived in docs/losses.md) w.r.t. the tempered logits `s_j`, for the loss
`L = head + c_tail * tail` as computed here::

    dL/ds_j = a * q_j                     for j not in I
    dL/ds_j = (a + b) * q_j - p_j         for j in I

with `b = (1-P)/(1-Q)` and `a = P - b * Q` when the tail term is active (tail mode, student
tail above `tail_mass_eps`), which reduce to `a = (P-Q)/(1-Q)` and `a + b = 1`; and `b = 0`,
`a = P` otherwise (truncated mode, or the guard holds `1-Q` at the constant `eps`). The
gradient w.r.t. the raw logits `z_j` is this divided by `T`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from student_client.losses.types import RowTerms

__all__ = [
    "GradientCoefficients",
    "TeacherMass",
    "VocabReductions",
    "row_terms",
    "teacher_column_gradient",
    "teacher_mass",
]


class TeacherMass(NamedTuple):
    """Teacher side of one batch of positions.

    - `probs`: `p_i = exp(l_i)`, `[N, K]`.
    - `mass`: `P = sum_I p_i`, `[N]` (may exceed 1 by rounding).
    - `tail`: `1 - P` computed as `-expm1(logsumexp l)` and clamped at 0, `[N]`.
    """

    probs: Tensor
    mass: Tensor
    tail: Tensor


class VocabReductions(NamedTuple):
    """What one pass over the (possibly sharded) vocabulary leaves per position.

    All relative to the row max and already summed over every vocab shard:

    - `sum_outside`: `sum_{j not in I} exp(s_j)`, `[N]` (the student tail, unnormalized).
    - `sum_inside`: `sum_{i in I} exp(s_i)`, `[N]`.
    - `teacher_logits`: `s_i` at the teacher's ids, `[N, K]`.
    - `kth_largest`: the K-th largest `s_j` over the whole vocabulary, `[N]`; None when the
      overlap statistic was not asked for (then `RowTerms.overlap` is NaN).
    """

    sum_outside: Tensor
    sum_inside: Tensor
    teacher_logits: Tensor
    kth_largest: Tensor | None


class GradientCoefficients(NamedTuple):
    """Per-position coefficients of the analytic gradient, `[N]` each (see module doc)."""

    outside: Tensor
    inside_extra: Tensor


def teacher_mass(logprobs: Tensor) -> TeacherMass:
    """Teacher probabilities, top-k mass and tail mass from top-k log-probs `[N, K]`.

    `-inf` log-probs are allowed (probability 0). Returns tensors in `logprobs`' dtype.
    """
    log_mass = torch.logsumexp(logprobs, dim=-1)
    return TeacherMass(
        probs=logprobs.exp(),
        mass=log_mass.exp(),
        tail=(-torch.expm1(log_mass)).clamp_min(0.0),
    )


def row_terms(
    teacher_logprobs: Tensor,
    teacher: TeacherMass,
    reductions: VocabReductions,
    *,
    tail_mode: bool,
    tail_mass_eps: float,
) -> tuple[RowTerms, GradientCoefficients]:
    """Per-position loss terms and gradient coefficients from the vocabulary reductions.

    Args:
        teacher_logprobs: `l_i`, `[N, K]`.
        teacher: `teacher_mass(teacher_logprobs)`.
        reductions: the vocabulary pass's per-position sums, `[N]` / `[N, K]`.
        tail_mode: True for the K+1-category loss, False for the truncated one.
        tail_mass_eps: lower guard of the student tail mass `1 - Q` in the tail term.

    Returns:
        `(terms, coefficients)`: `RowTerms` of `[N]` tensors (no autograd graph) and the
        `GradientCoefficients` the backward pass needs.

    `1 - Q` is the sum of the student's exponentials outside `I` divided by the total, so
    it is never formed as `1 - sum(q)` and keeps full relative precision when `Q -> 1`.
    """
    total = reductions.sum_outside + reductions.sum_inside
    log_student_q = reductions.teacher_logits - total.log().unsqueeze(-1)
    student_mass = reductions.sum_inside / total
    student_tail = reductions.sum_outside / total

    probs = teacher.probs
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    head = torch.where(probs > 0, probs * (teacher_logprobs - log_student_q), zero).sum(-1)

    guard_active = student_tail < tail_mass_eps
    log_student_tail = student_tail.clamp_min(tail_mass_eps).log()
    tail = torch.xlogy(teacher.tail, teacher.tail) - teacher.tail * log_student_tail

    if tail_mode:
        loss = head + tail
        inside_extra = torch.where(guard_active, zero, teacher.tail / student_tail)
    else:
        loss = head.clone()  # a tensor of its own: only `loss` carries a gradient
        inside_extra = torch.zeros_like(head)
    outside = teacher.mass - inside_extra * student_mass

    if reductions.kth_largest is None:
        overlap = torch.full_like(head, math.nan)
    else:
        inside_top = reductions.teacher_logits >= reductions.kth_largest.unsqueeze(-1)
        overlap = inside_top.to(probs.dtype).mean(-1)
    terms = RowTerms(
        loss=loss,
        head=head,
        tail=tail,
        teacher_mass=teacher.mass,
        student_mass=student_mass,
        overlap=overlap,
    )
    return terms, GradientCoefficients(outside=outside, inside_extra=inside_extra)


def teacher_column_gradient(
    student_probs: Tensor,
    teacher_probs: Tensor,
    coefficients: GradientCoefficients,
    scale: Tensor,
) -> Tensor:
    """Gradient at the teacher's columns, `scale * ((a + b) q_i - p_i)`, `[n, K]`.

    Args:
        student_probs: `q_i` at the teacher's ids, `[n, K]`.
        teacher_probs: `p_i`, `[n, K]`.
        coefficients: `a`, `b` of the rows, `[n]` each.
        scale: upstream gradient of each row's loss divided by `T`, `[n]`.
    """
    total_coefficient = (coefficients.outside + coefficients.inside_extra).unsqueeze(-1)
    return scale.unsqueeze(-1) * (total_coefficient * student_probs - teacher_probs)
