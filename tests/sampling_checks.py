"""Goodness of fit of sampled payloads: Pearson's chi-square over equal-mass bins.

Each position's vocabulary, sorted by the dense teacher probability (descending), is cut
into ``bins`` groups of about equal mass (fixed by the dense distribution alone, before
looking at the draws); the drawn counts per group are compared with ``N * mass``. The
statistics of independent positions add up, as do their degrees of freedom (bins - 1
each). The p-value is the chi-square survival function, ``torch.special.gammaincc``.
"""

from __future__ import annotations

import torch


def equal_mass_chi_square(
    ids: torch.Tensor, counts: torch.Tensor, dense_logprobs: torch.Tensor, bins: int = 16
) -> tuple[float, int]:
    """``(statistic, degrees of freedom)`` of the draws ``ids`` / ``counts`` ``[S, K]``
    against ``dense_logprobs`` ``[S, V]`` (all of each row's vocabulary)."""
    probs = dense_logprobs.double().exp()
    probs = probs / probs.sum(-1, keepdim=True)
    order = probs.argsort(-1, descending=True)
    cdf = torch.cumsum(torch.gather(probs, 1, order), -1)
    group_sorted = torch.clamp((cdf - 0.5 * torch.gather(probs, 1, order)) * bins, max=bins - 1)
    group = torch.empty_like(order)
    group.scatter_(1, order, group_sorted.long())  # token -> its bin
    rows = probs.shape[0]
    mass = torch.zeros(rows, bins, dtype=torch.float64).scatter_add_(1, group, probs)
    drawn = torch.gather(group, 1, ids.long())
    observed = torch.zeros(rows, bins, dtype=torch.float64).scatter_add_(1, drawn, counts.double())
    expected = mass * counts.double().sum(-1, keepdim=True)
    used = expected > 0
    statistic = float(((observed - expected) ** 2 / expected.clamp_min(1e-300))[used].sum())
    dof = int(used.sum()) - rows
    return statistic, dof


def chi_square_p_value(statistic: float, dof: int) -> float:
    """``P(chi2_dof >= statistic)``."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))
