"""Test helpers: a float64 dense oracle of every divergence x mode, built from scratch.

It writes down the coarse-grained distributions literally (docs/losses.md): each
vocabulary column is assigned to a category (the tail, one of the teacher's top-k ids, the
actual next token's own), `q̂` is the scatter-sum of `softmax(z / T)` over that assignment,
`p̂` the teacher's top-k probabilities, the actual token's and the rest for the tail; the
divergence is then the textbook formula, and autograd gives the gradients. Nothing of
`student_client.losses` is used.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DIVERGENCE_CASES",
    "MODES_OF",
    "coarse_divergence",
    "dense_divergence",
    "reference_rows",
]

#: (registry name, parameters) of every divergence the tests cover.
DIVERGENCE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("forward", {}),
    ("reverse", {}),
    ("jsd", {"beta": 0.3}),
]

#: The modes each divergence runs in.
MODES_OF: dict[str, tuple[str, ...]] = {
    "forward": ("tail", "truncated", "tail_actual"),
    "reverse": ("tail", "tail_actual"),
    "jsd": ("tail", "tail_actual"),
}

_NAMED_FLOOR = 1e-30  # the reverse KL's floor of a named category's teacher probability


def _xlogy_ratio(a: Tensor, b: Tensor) -> Tensor:
    """`a log(a / b)`, 0 where `a = 0`."""
    return torch.xlogy(a, a) - torch.xlogy(a, b)


def coarse_divergence(
    name: str, params: dict[str, Any], p: Tensor, q: Tensor, *, floor: Tensor | None = None
) -> Tensor:
    """`D(p || q)` summed over the last dim; `floor` (same shape) floors `p` inside the
    reverse KL's log (the tail at eps, named categories at 1e-30)."""
    if name == "forward":
        return _xlogy_ratio(p, q).sum(-1)
    if name == "reverse":
        floored = p if floor is None else torch.maximum(p, floor)
        return (torch.xlogy(q, q) - q * torch.log(floored)).sum(-1)
    if name == "jsd":  # GKD: m = beta p + (1 - beta) q
        beta = params.get("beta", 0.5)
        m = beta * p + (1 - beta) * q
        return (beta * _xlogy_ratio(p, m) + (1 - beta) * _xlogy_ratio(q, m)).sum(-1)
    raise AssertionError(f"no oracle for divergence {name!r}")


def dense_divergence(name: str, params: dict[str, Any], log_p: Tensor, log_q: Tensor) -> Tensor:
    """The full-vocabulary divergence of `[..., V]` log-distributions (no floors)."""
    return coarse_divergence(name, params, log_p.exp(), log_q.exp())


def reference_rows(
    logits: Tensor,
    ids: Tensor,
    logprobs: Tensor,
    *,
    divergence: str,
    params: dict[str, Any] | None = None,
    mode: str,
    temperature: float = 1.0,
    eps: float = 1e-6,
    sampled_ids: Tensor | None = None,
    sampled_logprobs: Tensor | None = None,
    support: str = "teacher",
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-position loss `[N]`, float64, differentiable w.r.t. `logits` `[N, V]`.

    `ids`, `logprobs` `[N, K]`; mode "tail_actual" also takes `sampled_ids` /
    `sampled_logprobs` `[N]` (NaN: no next token); supports "student" / "union" take
    `candidate_ids` / `candidate_logprobs` `[N, C]` (-1: padding). The categories of a
    row are listed one by one (teacher top-k, then candidates, then the actual token),
    an id already listed is skipped.
    """
    params = params or {}
    n_rows, vocab = logits.shape
    q = torch.softmax(logits.double() / temperature, dim=-1)
    listed: list[list[tuple[int, float]]] = []
    for row in range(n_rows):
        named: dict[int, float] = {}
        if support != "student":
            for i, lp in zip(ids[row].tolist(), logprobs[row].double().tolist(), strict=True):
                named.setdefault(int(i), math.exp(lp))
        if support != "teacher":
            assert candidate_ids is not None and candidate_logprobs is not None
            pairs = zip(candidate_ids[row].tolist(), candidate_logprobs[row].tolist(), strict=True)
            for i, lp in pairs:
                if i != -1:
                    named.setdefault(int(i), math.exp(lp))
        if mode == "tail_actual":
            assert sampled_ids is not None and sampled_logprobs is not None
            y, lp = int(sampled_ids[row]), float(sampled_logprobs[row])
            if math.isfinite(lp):
                named.setdefault(y, math.exp(lp))
        listed.append(list(named.items()))
    width = max([len(r) for r in listed] + [1])
    categories = width + 1
    assign = torch.zeros(n_rows, vocab, dtype=torch.long)
    p_hat = torch.zeros(n_rows, categories, dtype=torch.float64)
    for row, entries in enumerate(listed):
        for column, (i, p) in enumerate(entries, start=1):
            assign[row, i] = column
            p_hat[row, column] = p
    q_hat = torch.zeros(n_rows, categories, dtype=torch.float64).scatter_add(1, assign, q)
    p_hat[:, 0] = (1.0 - p_hat[:, 1:].sum(-1)).clamp_min(0.0)

    # The student's tail below eps: held constant at eps (no gradient through it).
    guard = q_hat[:, 0] < eps
    tail_q = torch.where(guard, torch.full_like(q_hat[:, 0], eps), q_hat[:, 0])
    if divergence == "reverse":
        # The reverse KL multiplies by q̂_tail itself: keep its value, drop its gradient.
        tail_q = torch.where(guard, q_hat[:, 0].detach(), q_hat[:, 0])
    q_used = torch.cat([tail_q.unsqueeze(-1), q_hat[:, 1:]], dim=-1)
    floor = torch.full_like(p_hat, _NAMED_FLOOR)
    floor[:, 0] = eps
    if mode == "truncated":
        return coarse_divergence(divergence, params, p_hat[:, 1:], q_used[:, 1:])
    if divergence == "reverse":
        # Its tail log uses max(q̂, eps) like the loss: xlogy(q, max(q, eps)) - q log p.
        named = coarse_divergence(
            divergence, params, p_hat[:, 1:], q_used[:, 1:], floor=floor[:, 1:]
        )
        tail_log = torch.log(torch.maximum(q_hat[:, 0], torch.tensor(eps, dtype=torch.float64)))
        tail_log = torch.where(guard, tail_log.detach(), tail_log)
        tail = q_used[:, 0] * (tail_log - torch.log(torch.maximum(p_hat[:, 0], floor[:, 0])))
        return named + tail
    return coarse_divergence(divergence, params, p_hat, q_used, floor=floor)
