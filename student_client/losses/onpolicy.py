"""The per-token on-policy distillation signal on the sampled tokens (docs/losses.md).

On-policy, the student samples `y_t` and the teacher scores it: the payload's
`sampled_logprobs[t] = log p(y_t)`; the student's own `log q(y_t)` comes from its logits.
The log-ratio `r_t = log q(y_t) - log p(y_t)` gives three estimators of the reverse KL
`KL(q || p)` at each position (samples from `q`; names as in verl's `kl_penalty`):

- `k1 = r` (unbiased, high variance, can be negative),
- `k2 = r**2 / 2` (biased, low variance; its gradient is that of the KL),
- `k3 = exp(-r) - 1 + r` (unbiased, non-negative, low variance: "low_var_kl"; verl
  clamps `-r` to [-20, 20] and the result to [-10, 10], here left to the caller).

OPD / MOPD trainers (Thinking Machines' on-policy distillation, NeMo-RL, slime) use the
stop-gradient advantage `A_t = log p(y_t) - log q(y_t) = -k1` as a per-token reward in a
policy-gradient loss `-sum_t A_t log q(y_t)`, whose gradient is the reverse KL's on the
sampled tokens. All functions are pure, take `[...]` tensors and a mask, and give 0 at
positions that do not count or where the teacher's log-prob is unknown (NaN: a sequence's
last position).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "KLEstimates",
    "kl_estimators",
    "masked_token_mean",
    "policy_gradient_loss",
    "reverse_kl_advantage",
    "sampled_token_logprobs",
]


class KLEstimates(NamedTuple):
    """Per-position estimators of `KL(q || p)` on the sampled tokens, `[...]` each."""

    k1: Tensor
    k2: Tensor
    k3: Tensor


def _counted(teacher_logprobs: Tensor, mask: Tensor | None) -> Tensor:
    """Positions that count: in `mask` (None: all) and with a known teacher log-prob."""
    known = ~teacher_logprobs.isnan()
    return known if mask is None else known & mask.to(torch.bool)


def sampled_token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """The student's `log q(tokens)`, `[...]`, from `logits` `[..., V]` (full vocabulary)
    and `tokens` `[...]` (e.g. `input_ids[:, 1:]` against `logits[:, :-1]`). Differentiable."""
    work = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
    log_q = torch.log_softmax(work / temperature, dim=-1)
    return log_q.gather(-1, tokens.unsqueeze(-1).to(torch.int64)).squeeze(-1)


def kl_estimators(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor | None = None
) -> KLEstimates:
    """`k1`, `k2`, `k3` per position, `[...]` (0 where not counted).

    Args:
        student_logprobs: `log q(y_t)` `[...]` (differentiable or not).
        teacher_logprobs: `log p(y_t)` `[...]`, the payload's `sampled_logprobs` (NaN: unknown).
        mask: `[...]` bool or 0/1, positions that count (None: all).
    """
    counted = _counted(teacher_logprobs, mask)
    zero = torch.zeros((), dtype=student_logprobs.dtype, device=student_logprobs.device)
    ratio = torch.where(
        counted, student_logprobs - teacher_logprobs.to(student_logprobs.dtype), zero
    )
    k1 = ratio
    k2 = 0.5 * ratio.square()
    k3 = torch.expm1(-ratio) + ratio
    return KLEstimates(k1=k1, k2=k2, k3=k3)


def reverse_kl_advantage(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Stop-gradient advantage `A_t = log p(y_t) - log q(y_t)`, `[...]`, detached, 0 where
    not counted (arguments as in `kl_estimators`)."""
    return -kl_estimators(student_logprobs.detach(), teacher_logprobs, mask).k1


def masked_token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` `[...]` over the counted positions of `mask` `[...]` (0 if none)."""
    kept = mask.to(torch.bool)
    total = torch.where(kept, values, torch.zeros((), dtype=values.dtype)).sum()
    return total / kept.sum().clamp_min(1).to(total.dtype)


def policy_gradient_loss(
    student_logprobs: Tensor,
    advantage: Tensor,
    mask: Tensor,
    teacher_logprobs: Tensor | None = None,
) -> Tensor:
    """`-mean_t A_t log q(y_t)` over the counted positions (scalar; 0 if none).

    Args:
        student_logprobs: `log q(y_t)` `[...]`, differentiable.
        advantage: `[...]`, treated as a constant (detached here).
        mask: `[...]` positions that count.
        teacher_logprobs: optional `[...]`; positions where it is NaN do not count.
    """
    counted = mask.to(torch.bool)
    if teacher_logprobs is not None:
        counted = _counted(teacher_logprobs, counted)
    return masked_token_mean(-advantage.detach() * student_logprobs, counted)
