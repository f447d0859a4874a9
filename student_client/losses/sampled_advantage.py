"""On-policy signal of the sampled tokens: the per-token reverse-KL advantage.

For a sequence the student sampled, the teacher's ``sampled_logprobs`` (payload row ``t``:
``log p_teacher(x[t+1] | x[:t+1])``) and the student's own log-prob of the same token give
the single-sample (k1) estimate of the reverse KL, ``log q(x) - log p(x)``, per token; its
negative is the advantage an on-policy (policy-gradient) update pushes up:

    A[b, t] = log p_teacher(x[b, t+1]) - log q_student(x[b, t+1])

With several teachers the payload's ``sampled_logprobs`` of each row come from that row's
own teacher (:mod:`student_client.multi_client`), so ``A`` is each row against its own
teacher. The advantage is a constant of the update (no gradient flows through it).
Written here as a small pure function; the divergence estimators of the losses (k2, k3)
can replace the k1 estimate where they are provided.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["reverse_kl_advantage", "sampled_token_logprobs"]


def sampled_token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """The student's log-prob of each next token: ``[B, T, V]`` logits (row ``t`` predicts
    ``tokens[:, t+1]``) and ``[B, T]`` tokens -> ``[B, T]`` float32, NaN at the last column
    (no next token), like the payload's ``sampled_logprobs``."""
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits, tokens: expected [B, T, V] and [B, T], got {list(logits.shape)} and "
            f"{list(tokens.shape)}"
        )
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None].long())[..., 0]
    nan = torch.full_like(picked[:, :1], float("nan"))
    return torch.cat([picked, nan], dim=1)


def reverse_kl_advantage(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Per-token advantage ``teacher - student`` log-prob of the sampled tokens.

    Args:
        student_logprobs: ``[B, S]`` the student's log-prob of each sampled token
            (:func:`sampled_token_logprobs`); detached here.
        teacher_logprobs: ``[B, S]`` the payload's ``sampled_logprobs`` (aligned to the
            same rows).
        mask: ``[B, S]`` bool, the rows that count (the payload's ``mask``); None: all.

    Returns:
        ``[B, S]`` float32; 0 where ``mask`` is False or either log-prob is NaN (a
        sequence's last position).
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs, teacher_logprobs: shapes {list(student_logprobs.shape)} and "
            f"{list(teacher_logprobs.shape)} differ"
        )
    adv = teacher_logprobs.float() - student_logprobs.detach().float()
    keep = torch.isfinite(adv)
    if mask is not None:
        if mask.shape != adv.shape:
            raise ValueError(f"mask: shape {list(mask.shape)}, expected {list(adv.shape)}")
        keep &= mask.bool()
    return torch.where(keep, adv, torch.zeros_like(adv))
