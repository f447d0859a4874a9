"""Dense reference of the loss terms: the slow, obviously-correct path.

It materializes the full `softmax` of `[..., V]` in the requested dtype, assigns every
vocabulary column to its category (the support's ids, the actual token's, the tail)
literally, sums `q` over each category with a scatter-add, hands the coarse-grained
distributions to the divergence and lets autograd differentiate it, so it costs several
copies of the logits in memory. Use it to check a new backend or to debug on small inputs;
train with `topk_kl_loss`. Single process only, no masking: every row must be valid.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from student_client.losses.divergences import CoarseRows, Divergence, get_divergence
from student_client.losses.types import LossMode, RowTerms, Support

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
    divergence: str | Divergence = "forward",
    support: Support = "teacher",
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
    sampled_ids: Tensor | None = None,
    sampled_logprobs: Tensor | None = None,
) -> RowTerms:
    """Per-position terms computed densely (no validation, no masking, no reduction).

    Args:
        logits: student logits `[..., V]`.
        teacher_ids: `[..., K]` distinct vocabulary ids per position.
        teacher_logprobs: `[..., K]`.
        mode: "tail", "truncated" or "tail_actual" (see `topk_kl_loss`).
        temperature: student temperature.
        tail_mass_eps: guard of the student tail mass `1 - Q`.
        dtype: dtype of the dense computation.
        divergence: a registry name or a divergence object (`divergences`).
        support: "teacher", "student" or "union" (docs/losses.md, "Supports").
        candidate_ids, candidate_logprobs: `[..., C]` for supports "student" / "union"
            (-1 pads; repeats and ids among the top-k count once).
        sampled_ids, sampled_logprobs: `[...]`, mode "tail_actual" only (NaN: no next token).

    Returns:
        `RowTerms` of `[...]` tensors in `dtype`; `loss` carries the autograd graph.
        `overlap` is NaN for support "student" (no teacher top-k among the categories).
    """
    resolved = get_divergence(divergence)
    positions = logits.shape[:-1]
    vocab = logits.shape[-1]
    n_rows = math.prod(positions)
    log_q = torch.log_softmax(logits.to(dtype).reshape(n_rows, vocab) / temperature, dim=-1)
    q = log_q.exp()

    ids, logprobs, given, named = _columns(
        teacher_ids, teacher_logprobs, support, candidate_ids, candidate_logprobs, n_rows
    )
    device = logits.device
    ids, logprobs, given = ids.to(device), logprobs.to(device=device, dtype=dtype), given.to(device)
    if mode == "tail_actual":
        assert sampled_ids is not None and sampled_logprobs is not None
        actual_logprob = sampled_logprobs.reshape(n_rows, 1).to(device=device, dtype=dtype)
        ids = torch.cat([ids, sampled_ids.reshape(n_rows, 1).to(device).long()], dim=-1)
        logprobs = torch.cat([logprobs, actual_logprob], dim=-1)
        given = torch.cat([given, actual_logprob.isfinite()], dim=-1)

    # Category of each vocabulary column: the first column of the row that names it
    # (written last), or the tail (-1).
    owner = torch.full((n_rows, vocab), -1, dtype=torch.long, device=device)
    for column in reversed(range(ids.shape[1])):
        index = torch.where(given[:, column], ids[:, column], 0).unsqueeze(-1)
        kept = owner.gather(1, index)
        mine = torch.full_like(kept, column)
        owner.scatter_(1, index, torch.where(given[:, column : column + 1], mine, kept))
    columns = torch.arange(ids.shape[1], device=device)
    present = given & (owner.gather(1, torch.where(given, ids, 0)) == columns)

    q_hat = torch.zeros(n_rows, ids.shape[1] + 1, dtype=dtype, device=device)
    q_hat = q_hat.scatter_add(1, owner + 1, q)
    zero = torch.zeros((), dtype=dtype, device=device)
    p_named = torch.where(present, logprobs.exp(), zero)
    p_tail = (1.0 - p_named.sum(-1)).clamp_min(0.0)
    q_tail = q_hat[:, 0]
    guard = q_tail < tail_mass_eps
    q_tail = torch.where(guard, q_tail.detach(), q_tail)  # held constant below the guard

    one = torch.ones((), dtype=dtype, device=device)
    rows = CoarseRows(
        teacher_probs=torch.cat([p_tail.unsqueeze(-1), torch.where(present, p_named, one)], -1),
        teacher_logprobs=torch.cat(
            [p_tail.log().unsqueeze(-1), torch.where(present, logprobs, zero)], -1
        ),
        student_probs=torch.cat(
            [q_tail.unsqueeze(-1), torch.where(present, q_hat[:, 1:], one)], -1
        ),
        student_logprobs=torch.cat(
            [
                q_tail.clamp_min(tail_mass_eps).log().unsqueeze(-1),
                torch.where(present, q_hat[:, 1:].clamp_min(1e-300).log(), zero),
            ],
            -1,
        ),
        tail_mass_eps=tail_mass_eps,
    )
    values, _ = resolved.terms(rows)
    values = torch.where(
        torch.cat([present.new_ones((present.shape[0], 1)), present], -1), values, zero
    )
    head = values[:, 1 : 1 + named].sum(-1)
    tail = values[:, 0] + values[:, 1 + named :].sum(-1)
    loss = head.clone() if mode == "truncated" else head + tail

    teacher_columns = teacher_ids.shape[-1] if support != "student" else 0
    if teacher_columns:
        student_top = torch.topk(log_q.detach(), teacher_columns, dim=-1).indices
        top = ids[:, :teacher_columns]
        overlap = (top.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1).to(dtype).mean(-1)
    else:
        overlap = torch.full((n_rows,), math.nan, dtype=dtype, device=device)
    terms = (
        loss,
        head.detach(),
        tail.detach(),
        p_named[:, :named].sum(-1),
        q_hat[:, 1 : 1 + named].detach().sum(-1),
        overlap,
    )
    return RowTerms(*(term.reshape(positions) for term in terms))


def _columns(
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    support: Support,
    candidate_ids: Tensor | None,
    candidate_logprobs: Tensor | None,
    n_rows: int,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """The support's `(ids, logprobs, given, M)`: `[N, M]` each, the top-k first."""
    parts: list[tuple[Tensor, Tensor]] = []
    if support != "student":
        parts.append((teacher_ids, teacher_logprobs))
    if support != "teacher":
        assert candidate_ids is not None and candidate_logprobs is not None
        parts.append((candidate_ids, candidate_logprobs))
    ids = torch.cat([i.reshape(n_rows, i.shape[-1]).long() for i, _ in parts], -1)
    logprobs = torch.cat([lp.reshape(n_rows, lp.shape[-1]).double() for _, lp in parts], -1)
    # (float64 here; the caller casts to the computation's dtype)
    return ids, logprobs, ids >= 0, ids.shape[1]
