"""The distillation loss of one batch, for any training loop: pure torch.

:func:`distillation_loss` runs the student's forward on a batch and computes the
tail-aware (or truncated) top-k KL against the teacher's payload aligned to the batch,
optionally blended with the model's own cross-entropy, ``alpha * CE + (1 - alpha) * KD``.
The Hugging Face ``Trainer`` (:mod:`student_client.integrations.hf_trainer`) calls it in
``compute_loss``; any other loop (or another trainer's ``compute_loss``) can too. It needs
no transformers: the model is any causal LM whose ``model(**inputs).logits`` is
``[B, T, V]`` (or, with ``fused``, one :func:`~student_client.losses.causal_lm_hidden_and_head`
accepts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from student_client.data.payload import TeacherPayload
from student_client.losses import (
    LossOptions,
    causal_lm_topk_kl_loss,
    fused_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.types import TopKKLStats

__all__ = [
    "PAYLOAD_KEYS",
    "DistillationConfig",
    "distillation_loss",
    "payload_columns",
    "per_teacher_metrics",
]

#: Batch keys that carry the teacher's payload (aligned to ``input_ids``): ``[B, T, K]``
#: ids, ``[B, T, K]`` log-probs, ``[B, T]`` bool mask, (mode ``"tail_actual"``) the
#: ``[B, T]`` log-prob of the actual next token, and (supports ``"student"`` /
#: ``"union"``) the student's ``[B, T, C]`` candidate ids (-1 pads) with the teacher's
#: ``[B, T, C]`` log-probs at them (NaN at -1).
PAYLOAD_KEYS = (
    "teacher_ids",
    "teacher_logprobs",
    "teacher_mask",
    "teacher_sampled_logprobs",
    "candidate_ids",
    "candidate_logprobs",
)
_CANDIDATE_KEYS = PAYLOAD_KEYS[4:]


@dataclass(frozen=True)
class DistillationConfig:
    """How the distillation loss is computed.

    Attributes:
        top_k: K requested from the teacher.
        loss: every option of the KD term (:class:`~student_client.losses.LossOptions`:
            divergence, mode, support, temperature, chunk size, ``validate``,
            ``tail_mass_eps``, ``clamp_min``, ``overlap``, ...). Mode ``"tail_actual"``
            asks the teacher for the sampled log-probs and takes the actual tokens from
            ``input_ids``; supports ``"student"`` / ``"union"`` take the candidates from
            the batch (``candidate_ids`` / ``candidate_logprobs``,
            :attr:`needs_candidates`).
        alpha: weight of the model's cross-entropy on ``labels``: the loss is
            ``alpha * CE + (1 - alpha) * KD``; 0 (the default) is pure distillation.
        dtype: wire dtype of the teacher's log-probs.
        prefetch_depth: batches kept with the teacher ahead of the one training.
        fused: compute the KD term from the last hidden states and the LM head with
            ``causal_lm_topk_kl_loss`` (no ``[B, T, V]`` logits; under FSDP2 it runs
            inside the root unit's forward); pure distillation only (``alpha`` 0).
    """

    top_k: int = 16
    loss: LossOptions = field(default_factory=LossOptions)
    alpha: float = 0.0
    dtype: str = "float16"
    prefetch_depth: int = 4
    fused: bool = False

    def __post_init__(self) -> None:
        if self.fused and self.alpha != 0.0:
            raise ValueError("fused: needs alpha = 0 (the CE term needs the logits)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: must lie in [0, 1], got {self.alpha}")
        if self.top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {self.top_k}")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth: must be >= 0, got {self.prefetch_depth}")
        if not isinstance(self.loss, LossOptions):
            raise ValueError(f"loss: must be a LossOptions, got {type(self.loss).__name__}")
        if self.loss.reduction != "mean":
            raise ValueError(f"loss: reduction must be 'mean' here, got {self.loss.reduction!r}")

    @property
    def include_sampled(self) -> bool:
        """Whether the teacher must send the sampled log-probs (mode ``"tail_actual"``)."""
        return self.loss.mode == "tail_actual"

    @property
    def needs_candidates(self) -> bool:
        """Whether the loss needs the student's candidates and the teacher's log-probs at
        them (support ``"student"`` or ``"union"``): batch keys ``candidate_ids`` /
        ``candidate_logprobs``, the payload's attributes of the same names."""
        return self.loss.support != "teacher"


def payload_columns(payload: TeacherPayload) -> dict[str, torch.Tensor]:
    """A payload aligned to a batch as the batch columns :data:`PAYLOAD_KEYS` (the sampled
    log-probs and the candidates, attributes ``candidate_ids`` / ``candidate_logprobs``,
    only when the payload has them)."""
    columns = {
        "teacher_ids": payload.ids,
        "teacher_logprobs": payload.logprobs,
        "teacher_mask": payload.mask,
    }
    if payload.sampled_logprobs is not None:
        columns["teacher_sampled_logprobs"] = payload.sampled_logprobs
    for key in _CANDIDATE_KEYS:
        value = getattr(payload, key, None)
        if value is not None:
            columns[key] = value
    return columns


def distillation_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    config: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """Student forward + distillation loss of one batch.

    Args:
        model: a causal LM (``model(**inputs).logits`` is ``[B, T, V]``).
        inputs: the batch: the model's inputs (``input_ids``, ``attention_mask``, ...,
            ``labels`` when ``config.alpha > 0``) plus :data:`PAYLOAD_KEYS` (the payload
            aligned to ``input_ids``: row ``t`` is the teacher's distribution over the
            token after ``input_ids[:, t]``, as ``logits[:, t]``; ``candidate_ids`` /
            ``candidate_logprobs`` ``[B, T, C]`` when :attr:`DistillationConfig.needs_candidates`).
        config: see :class:`DistillationConfig`.

    Returns:
        ``(loss, metrics, outputs)``: the scalar loss (mean over the batch's counted
        positions), the metrics as detached 0-d device tensors (``kd_*`` from
        :meth:`TopKKLStats.tensors`, ``ce_loss`` when blended; reading them is a host
        sync), and the model's outputs.
    """
    missing = [k for k in PAYLOAD_KEYS[:2] if k not in inputs]
    if missing:
        raise ValueError(
            f"inputs: missing {missing}; the batch needs the teacher payload (use "
            f"TopKDistillationTrainer with a teacher, or a payload dataset)"
        )
    model_inputs = {k: v for k, v in inputs.items() if k not in PAYLOAD_KEYS}
    if config.alpha == 0.0:
        model_inputs.pop("labels", None)
    elif "labels" not in model_inputs:
        raise ValueError(f"inputs: alpha = {config.alpha} > 0 needs 'labels' for the CE term")
    teacher = {
        "mask": inputs.get("teacher_mask"),
        "options": config.loss,
        **_actual_tokens(inputs, config),
        **_candidates(inputs, config),
    }
    if config.fused:
        kd, stats, head = causal_lm_topk_kl_loss(
            model, model_inputs, inputs["teacher_ids"], inputs["teacher_logprobs"], **teacher
        )
        return kd, _stats_metrics(stats), head
    outputs = model(**model_inputs)
    kd, stats = topk_kl_loss(
        outputs.logits, inputs["teacher_ids"], inputs["teacher_logprobs"], **teacher
    )
    metrics = _stats_metrics(stats)
    if config.alpha == 0.0:
        return kd, metrics, outputs
    ce = outputs.loss
    metrics["ce_loss"] = ce.detach()
    return config.alpha * ce + (1.0 - config.alpha) * kd, metrics, outputs


def _actual_tokens(inputs: Mapping[str, Any], config: DistillationConfig) -> dict[str, Any]:
    """Mode ``"tail_actual"``: ``sampled_ids`` (``input_ids`` shifted left by one) and the
    payload's ``sampled_logprobs``; other modes: nothing."""
    if not config.include_sampled:
        return {}
    if "teacher_sampled_logprobs" not in inputs:
        raise ValueError(
            "inputs: mode 'tail_actual' needs 'teacher_sampled_logprobs' (the payload's "
            "sampled_logprobs)"
        )
    input_ids = inputs["input_ids"]
    sampled_ids = torch.roll(input_ids, -1, dims=-1)  # the last column has no next token
    return {"sampled_ids": sampled_ids, "sampled_logprobs": inputs["teacher_sampled_logprobs"]}


def _candidates(inputs: Mapping[str, Any], config: DistillationConfig) -> dict[str, Any]:
    """Supports ``"student"`` / ``"union"``: the batch's ``candidate_ids`` /
    ``candidate_logprobs``; support ``"teacher"``: nothing (candidates in the batch are
    not used)."""
    if not config.needs_candidates:
        return {}
    missing = [key for key in _CANDIDATE_KEYS if inputs.get(key) is None]
    if missing:
        raise ValueError(
            f"inputs: support {config.loss.support!r} needs {missing} (the student's "
            f"[B, T, C] candidate ids and the payload's candidate_logprobs at them)"
        )
    return {key: inputs[key] for key in _CANDIDATE_KEYS}


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
    mask = inputs.get("teacher_mask")
    actual = {**_actual_tokens(inputs, config), **_candidates(inputs, config)}
    for name in dict.fromkeys(teachers):
        rows = torch.tensor([i for i, t in enumerate(teachers) if t == name], dtype=torch.long)

        def take(t: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
            return t[rows.to(t.device)]

        teacher: dict[str, Any] = {
            "mask": None if mask is None else take(mask),
            "options": config.loss,
            **{k: take(v) for k, v in actual.items()},
        }
        ids, lps = take(inputs["teacher_ids"]), take(inputs["teacher_logprobs"])
        if config.fused:
            _, stats = fused_topk_kl_loss(
                take(outputs.hidden), outputs.weight, ids, lps, bias=outputs.bias, **teacher
            )
        else:
            _, stats = topk_kl_loss(take(outputs.logits), ids, lps, **teacher)
        out.update({f"{k}/{name}": v for k, v in _stats_metrics(stats).items()})
    return out
