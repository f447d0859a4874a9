"""The teacher's rows a kernel sees: `teacher_rows` checks a `TeacherTargets` against the
student once, then builds the loss's columns `[N, M]` (`support.py`; a sampled teacher:
`sampled.py`). Shared by the logits path and the lm_head path."""

from __future__ import annotations

from torch import Tensor

from student_client.losses.input_checks import check_candidates, check_sampled, check_tensors
from student_client.losses.masking import prepare_teacher_rows
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
    ids, logprobs, counted = prepare_teacher_rows(
        teacher.ids,
        teacher.logprobs,
        teacher.mask,
        n_positions=n_positions,
        device=student.device,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    candidates = None
    if opts.support != "teacher":
        assert teacher.candidate_ids is not None and teacher.candidate_logprobs is not None
        candidates = (teacher.candidate_ids, teacher.candidate_logprobs)
    actual = None
    if opts.mode == "tail_actual":
        assert teacher.sampled_ids is not None and teacher.sampled_logprobs is not None
        actual = (teacher.sampled_ids, teacher.sampled_logprobs)
    rows = support_columns(
        ids,
        logprobs,
        counted,
        support=opts.support,
        candidates=candidates,
        actual=actual,
        global_vocab=shard.global_vocab,
        validate=opts.validate,
    )
    return opts, rows
