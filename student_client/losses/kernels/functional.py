"""Pure per-position math of the top-k losses (docs/losses.md), on reduced statistics.

The chunked pass (`chunked.py`) walks the vocabulary once per row and reduces it to a few
numbers per position; everything here works on those `[N]` / `[N, K']` tensors only, never
on `[N, V]`. Notation per position: `s = (z - max z) / T` (the tempered logits relative to
the row max), `q = softmax(s)`; support `I` (`support.py`: the teacher's top-k, the
student's candidates or both) with `p_i = exp(l_i)`; `P = sum_I p_i`, `Q = sum_I q_i`. The
columns are the support's ids, plus (mode "tail_actual") one for the actual next token
`y`; a column that is not a category (`present` False: a padded or repeated candidate, `y`
inside `I` or unknown) has `p̂ = q̂ = 0` and no term.

`row_terms` builds the coarse-grained distributions (`divergences.CoarseRows`: the tail,
the top-k categories, the actual token's), asks the divergence for its terms and
`h_c = dD/d(log q̂_c)`, and turns them into the gradient w.r.t. the tempered logits::

    dL/ds_j = a * q_j                     for j outside the teacher columns (the tail)
    dL/ds_j = (a + b) * q_j - pull_j      for j a teacher column

with `b = -h_tail / q̂_tail`, `a = -b - sum_c h_c` and `pull_j = -h_j` (forward KL, tail
mode: `b = (1-P)/(1-Q)`, `a = (P-Q)/(1-Q)`, `pull = p`). The tail is held constant (`b = 0`)
in truncated mode and where the student's tail is below `tail_mass_eps`. The gradient
w.r.t. the raw logits `z_j` is this divided by `T`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from student_client.losses.divergences import TAIL, CoarseRows, Divergence
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
    divergence: Divergence,
    present: Tensor | None = None,
    actual_token: bool = False,
    teacher_columns: int | None = None,
) -> tuple[RowTerms, GradientCoefficients, Tensor]:
    """Per-position loss terms and gradient coefficients from the vocabulary reductions.

    Args:
        teacher_logprobs: `l_c` of the columns, `[N, K']` (`support.py`: the support's
            columns, then with `actual_token` the actual token's), `-inf` where absent.
        teacher: `teacher_mass(teacher_logprobs)`.
        reductions: the vocabulary pass's per-position sums, `[N]` / `[N, K']`.
        tail_mode: True to include the tail category in the loss, False for "truncated".
        tail_mass_eps: lower guard of the student tail mass `1 - Q` in the tail term.
        divergence: the divergence of the coarse-grained distributions.
        present: bool `[N, K']`, the columns that are categories (None: all); an absent
            column has `p̂ = q̂ = 0` and no term.
        actual_token: whether the last column is the actual token's (its term counts in
            `tail`, its mass in neither `P` nor `Q`).
        teacher_columns: how many leading columns are the teacher's top-k, for the overlap
            statistic (None: all the support's columns).

    Returns:
        `(terms, coefficients, pull)`: `RowTerms` of `[N]` tensors (no autograd graph), the
        `GradientCoefficients` `a`, `b` and `pull` `[N, K']` (see module doc).

    `1 - Q` is the student's exponentials outside the columns over the total: never
    `1 - sum(q)`, so it keeps full relative precision when `Q -> 1`.
    """
    named = teacher_logprobs.shape[-1] - (1 if actual_token else 0)
    total = reductions.sum_outside + reductions.sum_inside
    log_student_q, student_q = _student_columns(reductions, total, present)
    student_tail = reductions.sum_outside / total
    probs = teacher.probs
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    if actual_token:
        student_mass = student_q[:, :named].sum(-1)
        mass = probs[:, :named].sum(-1)
    else:
        student_mass = reductions.sum_inside / total
        mass = teacher.mass

    guard_active = student_tail < tail_mass_eps
    rows = CoarseRows(
        teacher_probs=torch.cat([teacher.tail.unsqueeze(-1), probs], dim=-1),
        teacher_logprobs=torch.cat([teacher.tail.log().unsqueeze(-1), teacher_logprobs], dim=-1),
        student_probs=torch.cat([student_tail.unsqueeze(-1), student_q], dim=-1),
        student_logprobs=torch.cat(
            [student_tail.clamp_min(tail_mass_eps).log().unsqueeze(-1), log_student_q], dim=-1
        ),
        tail_mass_eps=tail_mass_eps,
    )
    values, grad_log = _category_terms(divergence, rows, present)
    frozen_tail = guard_active if tail_mode else torch.ones_like(guard_active)
    grad_log[:, TAIL] = torch.where(frozen_tail, zero, grad_log[:, TAIL])

    head = values[:, 1 : 1 + named].sum(-1)
    tail = values[:, TAIL] + values[:, 1 + named :].sum(-1)
    loss = head + tail if tail_mode else head.clone()  # only `loss` carries a gradient
    inside_extra = torch.where(frozen_tail, zero, -grad_log[:, TAIL] / student_tail)
    outside = -inside_extra - grad_log.sum(-1)

    overlap = _overlap(reductions, named if teacher_columns is None else teacher_columns, head)
    terms = RowTerms(
        loss=loss,
        head=head,
        tail=tail,
        teacher_mass=mass,
        student_mass=student_mass,
        overlap=overlap,
    )
    coefficients = GradientCoefficients(outside=outside, inside_extra=inside_extra)
    return terms, coefficients, -grad_log[:, 1:]


def _category_terms(
    divergence: Divergence, rows: CoarseRows, present: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The divergence's terms and gradient w.r.t. the student's log-probs, `[N, 1 + K']`
    each (the tail first), zero at the columns that are no category (`present` False)."""
    values, grad_log = divergence.terms(rows)
    if present is None:
        return values, grad_log
    present_columns = torch.cat([present.new_ones((present.shape[0], 1)), present], dim=-1)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(present_columns, values, zero), torch.where(present_columns, grad_log, zero)


def _student_columns(
    reductions: VocabReductions, total: Tensor, present: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The student's `log q_c` and `q_c` `[N, K']` at the columns (`-inf` / 0 where a
    column is no category), from the reductions and the row's `total` `[N]`."""
    log_student_q = reductions.teacher_logits - total.log().unsqueeze(-1)
    student_q = log_student_q.exp()
    if present is not None:
        student_q = torch.where(present, student_q, torch.zeros_like(student_q))
        log_student_q = torch.where(present, log_student_q, -math.inf)
    return log_student_q, student_q


def _overlap(reductions: VocabReductions, columns: int, like: Tensor) -> Tensor:
    """Share of the first `columns` columns (the teacher's top-k) among the student's
    top-`columns` ids, `[N]` like `like`; NaN where unknown (no k-th largest logit
    reduced, or no teacher columns)."""
    if reductions.kth_largest is None or columns == 0:
        return torch.full_like(like, math.nan)
    top = reductions.teacher_logits[:, :columns]
    return (top >= reductions.kth_largest.unsqueeze(-1)).to(like.dtype).mean(-1)


def teacher_column_gradient(
    student_probs: Tensor,
    teacher_probs: Tensor,
    coefficients: GradientCoefficients,
    scale: Tensor,
) -> Tensor:
    """Gradient at the teacher's columns, `scale * ((a + b) q_i - pull_i)`, `[n, K']`.

    Args:
        student_probs: `q_i` at the teacher's columns, `[n, K']`.
        teacher_probs: `pull_i` (`row_terms`; the forward KL's is `p_i`), `[n, K']`.
        coefficients: `a`, `b` of the rows, `[n]` each.
        scale: upstream gradient of each row's loss divided by `T`, `[n]`.
    """
    total_coefficient = (coefficients.outside + coefficients.inside_extra).unsqueeze(-1)
    return scale.unsqueeze(-1) * (total_coefficient * student_probs - teacher_probs)
