"""The support of the loss: which ids get a category of their own (docs/losses.md, "Supports").

One place builds the columns the kernels see, `[N, M]` ids and teacher log-probs with a
`present` mask, from the teacher's top-k, the student's candidates and (mode
"tail_actual") the actual next token:

- support "teacher": the teacher's top-k `[N, K]` (no mask: every column is a category);
- support "student": the candidates `[N, C]`;
- support "union": the top-k, then the candidates `[N, K + C]`;
- mode "tail_actual": one more column, the actual token.

A column is a category (`present`) where its position counts, its id is given (a
candidate's is not -1; the actual token's log-prob is finite) and no earlier column of the
row holds the same id: a candidate equal to a top-k id, a repeated candidate, an actual
token already in the support are absent. An absent column has id 0 and log-prob `-inf`,
belongs to no rank (never gathered from, never written) and stays in the tail, so the
kernels need no other change. Everything is `torch.where` / one stable sort: no host sync
(the value checks run only with `validate`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from student_client.losses.types import Support

__all__ = ["TeacherRows", "first_occurrences", "support_columns"]


class TeacherRows(NamedTuple):
    """The loss's columns for the kernels, over the flat positions `N`.

    - `ids`: `[N, M]` global ids (0, or a stand-in, where absent).
    - `logprobs`: `[N, M]` the target's log-weights (teacher log-probs; `-inf` where absent).
    - `counted`: bool `[N]`, the positions that count.
    - `present`: bool `[N, M]`, the columns that are categories; None: all of them.
    - `offset`: `[N]` or None, a constant (no gradient) added to each position's loss.
    - `teacher_columns`: how many leading columns are the teacher's top-k (K, or 0 for
      support "student"; None: all): the overlap statistic's.
    """

    ids: Tensor
    logprobs: Tensor
    counted: Tensor
    present: Tensor | None
    offset: Tensor | None = None
    teacher_columns: int | None = None


def first_occurrences(keys: Tensor) -> Tensor:
    """Bool `[N, M]`: True where `keys` `[N, M]` holds a value for the first time in its
    row (left to right). A stable sort puts equal values in their column order; each
    run's first is the leftmost. No host sync."""
    ordered, order = keys.sort(dim=-1, stable=True)
    repeat = torch.zeros_like(keys, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    return torch.empty_like(repeat).scatter_(-1, order, ~repeat)


def support_columns(
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    counted: Tensor,
    *,
    support: Support,
    candidates: tuple[Tensor, Tensor] | None,
    actual: tuple[Tensor, Tensor] | None,
) -> TeacherRows:
    """The columns of `support` (and of the actual token) for the kernels.

    Args:
        teacher_ids, teacher_logprobs: the teacher rows `[N, K]`, placeholders where a
            position does not count (`masking.neutralize_uncounted`).
        counted: bool `[N]`, the positions that count.
        support: "teacher", "student" or "union".
        candidates: `(candidate_ids, candidate_logprobs)` `[N, C]` on the rows' device
            (ids -1 pad a row; log-probs NaN there) for supports "student" / "union", else
            None.
        actual: mode "tail_actual": `(sampled_ids, sampled_logprobs)` `[N, 1]` (NaN: no
            next token), else None.

    The values are checked before (`input_checks.check_counted_values`).
    """
    device = teacher_ids.device
    parts: list[tuple[Tensor, Tensor, Tensor | None]] = []
    if support != "student":
        parts.append((teacher_ids, teacher_logprobs, None))
    if support != "teacher":
        assert candidates is not None  # input_checks.check_candidates
        ids, logprobs = candidates
        parts.append((ids, logprobs, (ids >= 0) & counted.unsqueeze(-1)))
    if actual is not None:
        ids, logprobs = actual
        parts.append((ids, logprobs, logprobs.isfinite() & counted.unsqueeze(-1)))
    teacher_columns = teacher_ids.shape[1] if support != "student" else 0
    if len(parts) == 1 and parts[0][2] is None:
        return TeacherRows(teacher_ids, teacher_logprobs, counted, None, None, teacher_columns)

    id_dtype = torch.int64
    dtype = teacher_logprobs.dtype
    for _, logprobs, _ in parts:
        dtype = torch.promote_types(dtype, logprobs.dtype)
    ids = torch.cat([part_ids.to(id_dtype) for part_ids, _, _ in parts], dim=-1)
    logprobs = torch.cat([part_logprobs.to(dtype) for _, part_logprobs, _ in parts], dim=-1)
    given = torch.cat(
        [
            torch.ones_like(part_ids, dtype=torch.bool) if valid is None else valid
            for part_ids, _, valid in parts
        ],
        dim=-1,
    )
    none = torch.full((), -1, dtype=id_dtype, device=device)
    present = given & first_occurrences(torch.where(given, ids, none))
    zero_id = torch.zeros((), dtype=id_dtype, device=device)
    impossible = torch.full((), float("-inf"), dtype=dtype, device=device)
    return TeacherRows(
        ids=torch.where(present, ids, zero_id),
        logprobs=torch.where(present, logprobs, impossible),
        counted=counted,
        present=present,
        teacher_columns=teacher_columns,
    )
