"""Test helpers: a plain dense float64 oracle of the losses and input generators.

The oracle is written independently of `student_client.losses`: it forms `q = softmax`,
`P`, `Q`, `1 - P`, `1 - Q` directly in float64 and follows docs/losses.md literally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Case",
    "analytic_gradient",
    "full_kl",
    "make_case",
    "oracle_loss",
    "oracle_rows",
]


@dataclass
class Case:
    """One random problem.

    - `logits`: student logits `[*lead, V]`.
    - `ids`, `logprobs`: the teacher's top-k `[*lead, K]`, sorted by log-prob, descending.
    - `teacher_full`: the teacher's full log-probs `[*lead, V]` the top-k was cut from.
    """

    logits: Tensor
    ids: Tensor
    logprobs: Tensor
    teacher_full: Tensor


def make_case(
    lead: tuple[int, ...],
    vocab: int,
    top_k: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    student_scale: float = 3.0,
    teacher_scale: float = 3.0,
) -> Case:
    """Random student logits and a teacher top-k cut from a random full distribution."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, vocab, generator=generator, dtype=torch.float64) * student_scale
    teacher_logits = torch.randn(*lead, vocab, generator=generator, dtype=torch.float64)
    teacher_full = torch.log_softmax(teacher_logits * teacher_scale, dim=-1)
    logprobs, ids = torch.topk(teacher_full, top_k, dim=-1)
    return Case(logits=logits.to(dtype), ids=ids, logprobs=logprobs, teacher_full=teacher_full)


def oracle_rows(
    logits: Tensor,
    ids: Tensor,
    logprobs: Tensor,
    *,
    mode: str,
    temperature: float = 1.0,
    eps: float = 1e-6,
) -> dict[str, Tensor]:
    """Per-position terms `[*lead]` in float64; `loss` is differentiable w.r.t. `logits`."""
    z = logits.double() / temperature
    q = torch.softmax(z, dim=-1)
    log_q = torch.log_softmax(z, dim=-1)
    log_p = logprobs.double()
    p = log_p.exp()
    ids = ids.long()
    q_top = q.gather(-1, ids)
    big_p = p.sum(-1)
    big_q = q_top.sum(-1)
    head = (p * (log_p - log_q.gather(-1, ids))).sum(-1)
    teacher_tail = (1.0 - big_p).clamp_min(0.0)
    student_tail = (1.0 - big_q).clamp_min(eps)
    tail = torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * torch.log(student_tail)
    loss = head + tail if mode == "tail" else head
    student_top = torch.topk(z.detach(), ids.shape[-1], dim=-1).indices
    overlap = (ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1).double().mean(-1)
    return {
        "loss": loss,
        "head": head.detach(),
        "tail": tail.detach(),
        "teacher_mass": big_p,
        "student_mass": big_q.detach(),
        "overlap": overlap,
    }


def oracle_loss(
    logits: Tensor,
    ids: Tensor,
    logprobs: Tensor,
    *,
    mode: str,
    temperature: float = 1.0,
    eps: float = 1e-6,
    clamp_min: float | None = None,
    mask: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Reduced float64 loss with the oracle's per-position terms."""
    rows = oracle_rows(logits, ids, logprobs, mode=mode, temperature=temperature, eps=eps)
    loss = rows["loss"]
    if clamp_min is not None:
        loss = loss.clamp_min(clamp_min)
    weight = torch.ones_like(loss) if mask is None else mask.double()
    loss = loss * weight
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / weight.sum().clamp_min(1.0)


def analytic_gradient(
    logits: Tensor, ids: Tensor, logprobs: Tensor, *, mode: str, temperature: float = 1.0
) -> Tensor:
    """The closed-form gradient (docs/losses.md) of the per-position loss, summed, float64.

    tail: `q_j - p_j` inside `I`, `q_j (P - Q) / (1 - Q)` outside; truncated:
    `q_j P - p_j [j in I]`; both divided by `T`. `[*lead, V]`.
    """
    q = torch.softmax(logits.double() / temperature, dim=-1)
    p = logprobs.double().exp()
    ids = ids.long()
    big_p = p.sum(-1, keepdim=True)
    big_q = q.gather(-1, ids).sum(-1, keepdim=True)
    inside = torch.zeros_like(q).scatter_(-1, ids, 1.0).bool()
    p_dense = torch.zeros_like(q).scatter_(-1, ids, p)
    if mode == "tail":
        grad = torch.where(inside, q - p_dense, q * (big_p - big_q) / (1.0 - big_q))
    else:
        grad = q * big_p - p_dense
    return grad / temperature


def full_kl(logits: Tensor, teacher_full: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Full-vocabulary `KL(p || q)` per position, float64 `[*lead]`."""
    log_q = torch.log_softmax(logits.double() / temperature, dim=-1)
    log_p = teacher_full.double()
    return (log_p.exp() * (log_p - log_q)).sum(-1)
