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

from student_client.losses.divergences import CoarseRows, get_divergence
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.sampled import sampled_target_weights
from student_client.losses.teacher import TeacherTargets
from student_client.losses.types import RowTerms, Support

__all__ = ["topk_kl_reference"]


def topk_kl_reference(
    logits: Tensor,
    teacher: TeacherTargets,
    options: LossOptions | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> RowTerms:
    """Per-position terms computed densely (no validation, no masking, no reduction; a
    teacher row of all NaN, which the teacher has no distribution for, gives zero terms
    and no gradient, as the other losses skip it).

    Args:
        logits: student logits `[..., V]`.
        teacher: a `TeacherTargets` as in `topk_kl_loss` (its `mask` is not used); with
            `sample_counts`, the sampled loss's terms.
        options: a `LossOptions`; its `mode`, `support`, `divergence`, `temperature` and
            `tail_mass_eps` are used (single process: no `process_group`).
        dtype: dtype of the dense computation.

    Returns:
        `RowTerms` of `[...]` tensors in `dtype`; `loss` carries the autograd graph.
        `overlap` is NaN for support "student" and for a sampled teacher (no teacher
        top-k among the categories).

    Example:
        >>> import torch
        >>> from student_client.losses import TeacherTargets, topk_kl_loss, topk_kl_reference
        >>> logits = torch.randn(2, 3, 10)
        >>> teacher = TeacherTargets(  # the teacher's top-2 at each of 2 x 3 positions
        ...     ids=torch.tensor([0, 1]).repeat(2, 3, 1),
        ...     logprobs=torch.tensor([0.5, 0.25]).log().repeat(2, 3, 1),
        ... )
        >>> terms = topk_kl_reference(logits, teacher)  # float64, per position
        >>> terms.loss.shape
        torch.Size([2, 3])
        >>> loss, _ = topk_kl_loss(logits, teacher)
        >>> torch.allclose(loss.double(), terms.loss.mean(), rtol=1e-5)
        True
    """
    opts = loss_options(options)
    if teacher.is_sampled:
        return _sampled_reference(logits, teacher, opts.temperature, dtype)
    positions = logits.shape[:-1]
    vocab = logits.shape[-1]
    n_rows = math.prod(positions)
    log_q = torch.log_softmax(logits.to(dtype).reshape(n_rows, vocab) / opts.temperature, dim=-1)
    device = logits.device
    ids, logprobs, given, named = _categories_given(teacher, opts, n_rows, device, dtype)
    unknown = teacher.logprobs.reshape(n_rows, -1).isnan().all(-1).to(device)
    given = given & ~unknown.unsqueeze(-1)  # a row without a distribution: no category
    present, q_hat = _student_masses(ids, given, log_q.exp())

    zero = torch.zeros((), dtype=dtype, device=device)
    p_named = torch.where(present, logprobs.exp(), zero)
    rows = _coarse_rows(p_named, logprobs, present, q_hat, opts.tail_mass_eps)
    values, _ = get_divergence(opts.divergence).terms(rows)
    values = torch.where(
        torch.cat([present.new_ones((present.shape[0], 1)), present], -1), values, zero
    )
    head = values[:, 1 : 1 + named].sum(-1)
    tail = values[:, 0] + values[:, 1 + named :].sum(-1)
    loss = head.clone() if opts.mode == "truncated" else head + tail

    teacher_columns = teacher.ids.shape[-1] if opts.support != "student" else 0
    terms = (
        loss,
        head.detach(),
        tail.detach(),
        p_named[:, :named].sum(-1),
        q_hat[:, 1 : 1 + named].detach().sum(-1),
        _overlap(ids[:, :teacher_columns], log_q.detach()),
    )
    return RowTerms(*(torch.where(unknown, zero, t).reshape(positions) for t in terms))


def _categories_given(
    teacher: TeacherTargets,
    opts: LossOptions,
    n_rows: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """The support's columns `[n_rows, M]` on `device`: ids, teacher log-probs (`dtype`),
    which are given, and how many are named by the support (the rest: mode
    "tail_actual"'s actual token, in a column of its own)."""
    ids, logprobs, given, named = _columns(
        teacher.ids,
        teacher.logprobs,
        opts.support,
        teacher.candidate_ids,
        teacher.candidate_logprobs,
        n_rows,
    )
    ids, logprobs, given = ids.to(device), logprobs.to(device=device, dtype=dtype), given.to(device)
    if opts.mode == "tail_actual":
        assert teacher.sampled_ids is not None and teacher.sampled_logprobs is not None
        actual_logprob = teacher.sampled_logprobs.reshape(n_rows, 1).to(device=device, dtype=dtype)
        ids = torch.cat([ids, teacher.sampled_ids.reshape(n_rows, 1).to(device).long()], dim=-1)
        logprobs = torch.cat([logprobs, actual_logprob], dim=-1)
        given = torch.cat([given, actual_logprob.isfinite()], dim=-1)
    return ids, logprobs, given, named


def _student_masses(ids: Tensor, given: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """Each vocabulary column of `q` `[n, V]` put in its category, literally: the first
    given column of the row that names it (written last), or the tail. Returns which
    columns `[n, M]` are categories (`present`: given, and their id's first column) and
    the student's mass of each category `[n, 1 + M]` (the tail's first)."""
    n_rows, vocab = q.shape
    owner = torch.full((n_rows, vocab), -1, dtype=torch.long, device=q.device)
    for column in reversed(range(ids.shape[1])):
        index = torch.where(given[:, column], ids[:, column], 0).unsqueeze(-1)
        kept = owner.gather(1, index)
        mine = torch.full_like(kept, column)
        owner.scatter_(1, index, torch.where(given[:, column : column + 1], mine, kept))
    columns = torch.arange(ids.shape[1], device=q.device)
    present = given & (owner.gather(1, torch.where(given, ids, 0)) == columns)
    q_hat = torch.zeros(n_rows, ids.shape[1] + 1, dtype=q.dtype, device=q.device)
    return present, q_hat.scatter_add(1, owner + 1, q)


def _coarse_rows(
    p_named: Tensor, logprobs: Tensor, present: Tensor, q_hat: Tensor, tail_mass_eps: float
) -> CoarseRows:
    """The coarse-grained distributions `[n, 1 + M]` (the tail first, then each column;
    a column that is no category gets a neutral 1 / 0) the divergence compares."""
    dtype, device = q_hat.dtype, q_hat.device
    p_tail = (1.0 - p_named.sum(-1)).clamp_min(0.0)
    q_tail = q_hat[:, 0]
    guard = q_tail < tail_mass_eps
    q_tail = torch.where(guard, q_tail.detach(), q_tail)  # held constant below the guard
    zero = torch.zeros((), dtype=dtype, device=device)
    one = torch.ones((), dtype=dtype, device=device)
    return CoarseRows(
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


def _overlap(top: Tensor, log_q: Tensor) -> Tensor:
    """Share of the teacher's top-k ids `top` `[n, K]` among the student's top-K of
    `log_q` `[n, V]`, `[n]` (NaN for K = 0: no teacher top-k among the categories)."""
    if not top.shape[1]:
        return torch.full((top.shape[0],), math.nan, dtype=log_q.dtype, device=log_q.device)
    student_top = torch.topk(log_q, top.shape[1], dim=-1).indices
    return (top.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1).to(log_q.dtype).mean(-1)


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


def _sampled_reference(
    logits: Tensor, teacher: TeacherTargets, temperature: float, dtype: torch.dtype
) -> RowTerms:
    """The sampled loss densely: per position `sum_i w_i (log p_i - log q_i)` over the drawn
    ids (`w` the unbiased target weights); `head` is `sum_i w_i (log w_i - log q_i)`."""
    positions, vocab = logits.shape[:-1], logits.shape[-1]
    n_rows = math.prod(positions)
    top_k = teacher.ids.shape[-1]
    log_q = torch.log_softmax(logits.to(dtype).reshape(n_rows, vocab) / temperature, dim=-1)
    lp = teacher.logprobs.reshape(n_rows, top_k).to(device=logits.device, dtype=dtype)
    assert teacher.sample_counts is not None  # the caller's `is_sampled`
    normalizer = teacher.proposal_log_normalizer
    weights = sampled_target_weights(
        teacher.sample_counts.reshape(n_rows, top_k).to(logits.device),
        lp,
        proposal_temperature=teacher.proposal_temperature,
        proposal_log_normalizer=None if normalizer is None else normalizer.reshape(n_rows),
    ).to(dtype)
    drawn = weights > 0
    ids = torch.where(drawn, teacher.ids.reshape(n_rows, top_k).to(logits.device).long(), 0)
    log_q_drawn = log_q.gather(1, ids)
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    log_w = torch.where(drawn, weights.clamp_min(1e-300).log(), zero)
    loss = torch.where(drawn, weights * (lp - log_q_drawn), zero).sum(-1)
    head = torch.where(drawn, weights * (log_w - log_q_drawn), zero).sum(-1)
    terms = (
        loss,
        head.detach(),
        torch.zeros_like(head),
        weights.sum(-1),
        torch.where(drawn, log_q_drawn.detach().exp(), zero).sum(-1),
        torch.full((n_rows,), math.nan, dtype=dtype, device=logits.device),
    )
    return RowTerms(*(term.reshape(positions) for term in terms))
