"""Dense reference of the top-k KL terms: the slow, obviously-correct path.

It materializes the full `log_softmax` of `[..., V]` in the requested dtype and lets autograd
differentiate it, so it costs several copies of the logits in memory. Use it to check a
new backend or to debug on small inputs; train with `topk_kl_loss`. Single process only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from student_client.losses.types import LossMode, RowTerms

__all__ = ["topk_kl_reference"]


def topk_kl_reference(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    mode: LossMode = "tail",
    temperature: float = 1.0,
    tail_mass_eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> RowTerms:
    """Per-position terms computed densely (no validation, no masking, no reduction).

    Args:
        logits: student logits `[..., V]`.
        teacher_ids: `[..., K]` distinct vocabulary ids per position.
        teacher_logprobs: `[..., K]`.
        mode: "tail" or "truncated" (see `topk_kl_loss`).
        temperature: student temperature.
        tail_mass_eps: guard of the student tail mass `1 - Q`.
        dtype: dtype of the dense computation.

    Returns:
        `RowTerms` of `[...]` tensors in `dtype`; `loss` carries the autograd graph.
    """
    log_q = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    ids = teacher_ids.to(torch.int64)
    log_q_top = log_q.gather(-1, ids)
    log_p = teacher_logprobs.to(dtype)
    p = log_p.exp()
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    head = torch.where(p > 0, p * (log_p - log_q_top), zero).sum(-1)

    log_teacher_mass = torch.logsumexp(log_p, dim=-1)
    teacher_tail = (-torch.expm1(log_teacher_mass)).clamp_min(0.0)
    log_student_mass = torch.logsumexp(log_q_top, dim=-1)
    student_tail = -torch.expm1(log_student_mass)
    tail = torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * torch.log(
        student_tail.clamp_min(tail_mass_eps)
    )
    loss = head + tail if mode == "tail" else head.clone()

    student_top = torch.topk(log_q.detach(), ids.shape[-1], dim=-1).indices
    inside = (ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    return RowTerms(
        loss=loss,
        head=head.detach(),
        tail=tail.detach(),
        teacher_mass=log_teacher_mass.exp(),
        student_mass=log_student_mass.detach().exp(),
        overlap=inside.to(dtype).mean(-1),
    )
