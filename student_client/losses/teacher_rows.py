"""The teacher's rows a kernel sees: `teacher_rows` checks a `TeacherTargets` against the
student (shapes, then the counted rows' values: `input_checks.py`, once), then builds the
loss's columns `[N, M]` (`support.py`; a sampled teacher: `sampled.py`). Shared by the
logits path and the lm_head path."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from student_client.losses.input_checks import (
    check_candidates,
    check_counted_values,
    check_sampled,
    check_tensors,
)
from student_client.losses.masking import counted_rows
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.sampled import sampled_options, sampled_rows
from student_client.losses.support import TeacherRows, support_columns
from student_client.losses.teacher import TeacherTargets

__all__ = ["teacher_rows"]


def teacher_rows(
    student: Tensor,
    teacher: TeacherTargets,
    opts: LossOptions,
    shard: VocabShard,
    names: dict[str, str],
) -> tuple[LossOptions, TeacherRows]:
    """Check `teacher` against `student` (`[..., V_local]` logits or `[..., H]` hidden
    states, named by `names`); the options the kernels run with and the loss's columns
    `[N, M]` (`support.py`; a sampled teacher: `sampled.py`)."""
    if not isinstance(teacher, TeacherTargets):
        raise ValueError(
            f"teacher: must be a TeacherTargets (TeacherTargets.from_payload(payload)), "
            f"got {type(teacher).__name__}"
        )
    if teacher.is_sampled:
        opts = sampled_options(opts)
    check_tensors(
        student,
        teacher.ids,
        teacher.logprobs,
        teacher.mask,
        global_vocab=shard.global_vocab,
        **names,
    )
    if teacher.is_sampled:
        return opts, sampled_rows(student, teacher, opts, shard)
    positions, device = student.shape[:-1], student.device
    check_sampled(opts.mode, teacher.sampled_ids, teacher.sampled_logprobs, positions, device)
    check_candidates(
        opts.support, teacher.candidate_ids, teacher.candidate_logprobs, positions, device
    )
    n_positions = student[..., 0].numel() if student.dim() else 0
    flat = _flat_rows(teacher, opts, n_positions, device)
    counted, ids, logprobs = counted_rows(flat.ids, flat.logprobs, teacher.mask, device)
    if opts.validate:  # the values a loss reads, once, before the support's columns
        check_counted_values(
            teacher.mask,
            counted,
            (ids, logprobs),  # the counted rows as given
            candidates=flat.candidates,
            actual=flat.actual,
            global_vocab=shard.global_vocab,
        )
    rows = support_columns(
        ids,
        logprobs,
        counted,
        support=opts.support,
        candidates=flat.candidates,
        actual=flat.actual,
    )
    return opts, rows


class _FlatRows(NamedTuple):
    """A teacher value's rows as `[N, ...]` tensors (the log-probs detached; candidates
    and actual token on the student's device)."""

    ids: Tensor  # [N, K]
    logprobs: Tensor  # [N, K]
    candidates: tuple[Tensor, Tensor] | None  # [N, C] ids and log-probs
    actual: tuple[Tensor, Tensor] | None  # [N, 1] the actual token's id and log-prob


def _flat_rows(
    teacher: TeacherTargets, opts: LossOptions, n_positions: int, device: torch.device
) -> _FlatRows:
    """`teacher`'s rows flattened to `n_positions` (shapes checked), with the candidates
    of supports "student" / "union" and mode "tail_actual"'s actual token."""
    top_k = teacher.ids.shape[-1]
    ids = teacher.ids.reshape(n_positions, top_k)
    logprobs = teacher.logprobs.detach().reshape(n_positions, top_k)
    candidates = None
    if opts.support != "teacher":
        assert teacher.candidate_ids is not None and teacher.candidate_logprobs is not None
        pair = (teacher.candidate_ids, teacher.candidate_logprobs)
        candidates = _flat(pair, n_positions, teacher.candidate_ids.shape[-1], device)
    actual = None
    if opts.mode == "tail_actual":
        assert teacher.sampled_ids is not None and teacher.sampled_logprobs is not None
        actual = _flat((teacher.sampled_ids, teacher.sampled_logprobs), n_positions, 1, device)
    return _FlatRows(ids, logprobs, candidates, actual)


def _flat(
    pair: tuple[Tensor, Tensor], n_rows: int, width: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """`(ids, logprobs)` `[..., width]` (or `[...]` for width 1) -> `[N, width]` on
    `device`; the log-probs detached."""
    ids, logprobs = pair
    return (
        ids.reshape(n_rows, width).to(device=device),
        logprobs.detach().reshape(n_rows, width).to(device=device),
    )
