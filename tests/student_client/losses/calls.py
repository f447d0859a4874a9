"""One keyword dict per parametrized case -> the losses' `(teacher, options)`.

Parametrized loss tests keep their cases as one dict of keywords (teacher fields and loss
options mixed, e.g. `{"mode": "tail_actual", "sampled_ids": ..., "chunk_size": 5}`);
`teacher_and_options` sorts them into the one teacher value and the one options object
every loss takes: `topk_kl_loss(logits, *teacher_and_options(ids, logprobs, **case))`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from student_client.losses import LossOptions, TeacherTargets

TEACHER_FIELDS = (
    "mask",
    "sampled_ids",
    "sampled_logprobs",
    "candidate_ids",
    "candidate_logprobs",
    "sample_counts",
    "proposal_log_normalizer",
    "proposal_temperature",
)


def teacher_and_options(
    ids: Tensor, logprobs: Tensor, *, options: LossOptions | None = None, **keywords: Any
) -> tuple[TeacherTargets, LossOptions]:
    """`keywords` split into `TeacherTargets` fields and `LossOptions` fields (over
    `options`); `mode=None` is dropped."""
    teacher = {k: keywords.pop(k) for k in TEACHER_FIELDS if k in keywords}
    if keywords.get("mode", "") is None:
        del keywords["mode"]
    base = options if options is not None else LossOptions()
    opts = dataclasses.replace(base, **keywords) if keywords else base
    return TeacherTargets(ids, logprobs, **teacher), opts
