"""The divergence interface: what a divergence supplies to the loss kernels (docs/losses.md).

The vocabulary pass reduces each row to its coarse-grained distributions: `C` categories,
the teacher's `p̂` and the student's `q̂` (`CoarseRows`). A divergence `D(p̂, q̂)` turns them
into per-category loss terms and `h_c = q̂_c dD/dq̂_c = dD/d(log q̂_c)`. Everything else is
shared (`functional.row_terms`): with `ḡ = sum_c h_c`, the gradient w.r.t. the tempered
student logits `s_j` is

    dD/ds_j = h_c - q_j ḡ                  for j the one column of a named category c
    dD/ds_j = q_j (h_tail / q̂_tail - ḡ)    for j in the tail

so one coefficient per row for every column outside the named categories and one value
per named column: the shape the chunked, fused and vocab-parallel kernels already apply.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor

__all__ = ["TAIL", "CoarseRows", "Divergence"]

TAIL = 0
"""Column of the tail category in `CoarseRows` (columns 1..K: the teacher's top-k ids; in
mode "tail_actual" column K+1: the actual next token's own category)."""


class CoarseRows(NamedTuple):
    """Coarse-grained distributions of `n` rows over `C` categories (statistics dtype).

    - `teacher_probs`: `p̂_c`, `[n, C]`, `>= 0`.
    - `teacher_logprobs`: `log p̂_c`, `[n, C]` (`-inf` where `p̂_c = 0`).
    - `student_probs`: `q̂_c`, `[n, C]`.
    - `student_logprobs`: `log q̂_c`, `[n, C]`, finite; the tail's is held at
      `log(tail_mass_eps)` when `q̂_tail < tail_mass_eps` (that row's tail is then treated
      as a constant: its `h` is ignored).
    - `tail_mass_eps`: the guard, for divergences that also need one on the teacher side.

    A category absent from a row (the actual token's when it is inside the top-k or
    unknown) has `p̂ = q̂ = 0` and `log q̂ = -inf`; whatever a divergence returns there is
    ignored.
    """

    teacher_probs: Tensor
    teacher_logprobs: Tensor
    student_probs: Tensor
    student_logprobs: Tensor
    tail_mass_eps: float


class Divergence(Protocol):
    """A divergence between coarse-grained distributions (a frozen dataclass, hashable).

    `name` is its registry name (`divergences.lookup.DIVERGENCES`); `truncatable`
    says whether mode "truncated" (the top-k terms alone) applies to it.
    """

    @property
    def name(self) -> str: ...

    @property
    def truncatable(self) -> bool: ...

    def terms(self, rows: CoarseRows) -> tuple[Tensor, Tensor]:
        """`(loss_terms, h)`, both `[n, C]`: the divergence is `loss_terms.sum(-1)` and
        `h_c = q̂_c dD/dq̂_c` (the gradient w.r.t. `log q̂_c`). No autograd graph."""
        ...
