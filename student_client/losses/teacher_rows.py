"""The teacher's rows a kernel sees: `teacher_rows` checks a `TeacherTargets` against the
student in one call (`input_checks.check_teacher`: shapes, the counted rows, their
values), then builds the loss's columns `[N, M]` (`support.py`; a sampled teacher:
`sampled.py`). Shared by the logits path and the lm_head path."""

from __future__ import annotations

from torch import Tensor

from student_client.losses.input_checks import check_teacher, check_tensors
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
        return opts, sampled_rows(student, teacher, opts, shard)
    checked = check_teacher(
        student,
        teacher,
        mode=opts.mode,
        support=opts.support,
        validate=opts.validate,
        global_vocab=shard.global_vocab,
        names=names,
    )
    rows = support_columns(
        checked.ids,
        checked.logprobs,
        checked.counted,
        support=opts.support,
        candidates=checked.candidates,
        actual=checked.actual,
    )
    return opts, rows
