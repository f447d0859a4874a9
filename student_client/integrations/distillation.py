"""The distillation loss of one batch, for any training loop: pure torch at run time.

:func:`distillation_loss` runs the student's forward on a batch and computes the loss
against the teacher's payload aligned to the batch (the batch's :data:`TEACHER_KEY`),
optionally blended with the model's own cross-entropy, ``alpha * CE + (1 - alpha) * KD``.
The Hugging Face ``Trainer`` (:mod:`student_client.integrations.hf_trainer`) calls it in
``compute_loss``; any other loop (or another trainer's ``compute_loss``) can too. It needs
no transformers: the model is any causal LM whose ``model(**inputs).logits`` is
``[B, T, V]`` (or, with ``fused``, one :func:`~student_client.losses.causal_lm_hidden_and_head`
accepts). Its configuration is
:class:`~student_client.integrations.distillation_config.DistillationConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from student_client.losses import TeacherTargets, lm_head_topk_kl_loss, topk_kl_loss
from student_client.losses.causal_lm_topk_kl import causal_lm_loss_and_head
from student_client.losses.types import TopKKLStats

if TYPE_CHECKING:
    from student_client.integrations.distillation_config import DistillationConfig

__all__ = ["TEACHER_KEY", "batch_teacher", "distillation_loss", "per_teacher_metrics"]

#: The batch key of the teacher's answer aligned to ``input_ids``: a ``TeacherPayload``
#: (``[B, T, K]`` rows, what a client or a payload dataset gives) or a ``TeacherTargets``.
TEACHER_KEY = "teacher"


def batch_teacher(inputs: Mapping[str, Any], config: DistillationConfig) -> TeacherTargets:
    """The batch's teacher value for the loss, on the device of ``input_ids``: the payload
    under :data:`TEACHER_KEY` in one call (``TeacherTargets.from_payload``), the actual
    next tokens taken from ``input_ids`` in mode ``"tail_actual"``."""
    payload = inputs.get(TEACHER_KEY)
    if payload is None:
        raise ValueError(
            f"inputs: missing {TEACHER_KEY!r}; the batch needs the teacher payload (use "
            f"TopKDistillationTrainer with a teacher, or a payload dataset)"
        )
    input_ids = inputs["input_ids"]
    if isinstance(payload, TeacherTargets):
        return payload.to(input_ids.device)
    actual = config.loss.mode == "tail_actual"
    if actual and getattr(payload, "sampled_logprobs", None) is None:
        raise ValueError(
            "inputs: mode 'tail_actual' needs the payload's sampled_logprobs (ask with "
            "include_sampled=True)"
        )
    if config.loss.support != "teacher" and getattr(payload, "candidate_ids", None) is None:
        raise ValueError(
            f"inputs: support {config.loss.support!r} needs the payload's candidate_ids / "
            f"candidate_logprobs (the student's candidates, DistillationConfig.candidates)"
        )
    teacher = TeacherTargets.from_payload(payload, input_ids=input_ids if actual else None)
    return teacher.to(input_ids.device)


def distillation_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    config: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """Student forward + distillation loss of one batch.

    Args:
        model: a causal LM (``model(**inputs).logits`` is ``[B, T, V]``).
        inputs: the batch: the model's inputs (``input_ids``, ``attention_mask``, ...,
            ``labels`` when ``config.alpha > 0``) plus :data:`TEACHER_KEY`, the payload
            aligned to ``input_ids`` (row ``t`` is the teacher's distribution over the
            token after ``input_ids[:, t]``, as ``logits[:, t]``).
        config: a :class:`~student_client.integrations.distillation_config.DistillationConfig`.

    Returns:
        ``(loss, metrics, outputs)``: the scalar loss (mean over the batch's counted
        positions), the metrics as detached 0-d device tensors (``kd_*`` from
        :meth:`TopKKLStats.tensors`, ``ce_loss`` when blended; reading them is a host
        sync), and the model's outputs (with ``config.fused`` the ``LMHeadInputs``).
    """
    teacher = batch_teacher(inputs, config)
    model_inputs = {k: v for k, v in inputs.items() if k != TEACHER_KEY}
    if config.alpha == 0.0:
        model_inputs.pop("labels", None)
    elif "labels" not in model_inputs:
        raise ValueError(f"inputs: alpha = {config.alpha} > 0 needs 'labels' for the CE term")
    if config.fused:
        kd, stats, head = causal_lm_loss_and_head(model, model_inputs, teacher, config.loss)
        return kd, _stats_metrics(stats), head
    outputs = model(**model_inputs)
    kd, stats = topk_kl_loss(outputs.logits, teacher, config.loss)
    metrics = _stats_metrics(stats)
    if config.alpha == 0.0:
        return kd, metrics, outputs
    ce = outputs.loss
    metrics["ce_loss"] = ce.detach()
    return config.alpha * ce + (1.0 - config.alpha) * kd, metrics, outputs


def _stats_metrics(stats: TopKKLStats) -> dict[str, torch.Tensor]:
    return {f"kd_{name}": value for name, value in stats.tensors().items()}


@torch.no_grad()
def per_teacher_metrics(
    outputs: Any, inputs: Mapping[str, Any], config: DistillationConfig, teachers: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The ``kd_*`` statistics of each teacher's rows of a batch, as ``kd_<stat>/<name>``
    (detached 0-d device tensors, as :func:`distillation_loss`'s metrics).

    ``outputs`` is what :func:`distillation_loss` returned (the model's outputs with
    ``logits`` ``[B, T, V]``, or with ``config.fused`` the ``hidden`` ``[B, T, H]`` and
    head); ``teachers``: the ``B`` rows' teacher names. Computed again on each teacher's
    rows without gradient (the loss itself is the batch's, unchanged).
    """
    out: dict[str, torch.Tensor] = {}
    teacher = batch_teacher(inputs, config)
    for name in dict.fromkeys(teachers):
        rows = torch.tensor([i for i, t in enumerate(teachers) if t == name], dtype=torch.long)

        def take(t: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
            return t[rows.to(t.device)]

        mine = teacher.apply(take)
        if config.fused:
            head = (outputs.weight, outputs.bias)
            _, stats = lm_head_topk_kl_loss(head, take(outputs.hidden), mine, config.loss)
        else:
            _, stats = topk_kl_loss(take(outputs.logits), mine, config.loss)
        out.update({f"{k}/{name}": v for k, v in _stats_metrics(stats).items()})
    return out
