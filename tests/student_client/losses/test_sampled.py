"""The sampled loss: float64 oracle on a given sample, unbiasedness over many seeds, the
fused and no-sync paths, and the refused options.

Unbiasedness: with `M` independent payloads (seeds) the mean gradient of the sampled loss
w.r.t. the student logits is compared with the full-vocabulary forward-KL gradient
`q - p` coordinate by coordinate, as z-scores `(mean - truth) / (s / sqrt(M))` from the
sample standard deviation `s`. Two statistics, both at a stated false-alarm rate:

- `max |z|` over the `C = 3 * 47 * 123 = 17343` coordinates (skewness-corrected, see
  `_z_scores`) below the two-sided Bonferroni bound at family-wise level `ALPHA`
  (`z* = Phi^-1(1 - ALPHA / (2 C))` = 5.43);
- per position, the z-score of the gradient's projection on a fixed random direction;
  positions are independent, so `sum z^2` over the `R = 141` positions is chi-square with
  `R` degrees of freedom for an unbiased estimator: its p-value must exceed `ALPHA`.

The same statistics on a top-k target (the biased estimator) must fail, so the test can
fail.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from host_sync import NoHostSync

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.sampled import sampled_target_weights
from topk_protocol.sampling import sample_rows

ALPHA = 1e-3
SHAPE = (3, 47)  # positions
VOCAB = 123


def _teacher(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(
        torch.randn(*SHAPE, VOCAB, generator=g, dtype=torch.float64) * scale, -1
    )


def _draw(teacher: torch.Tensor, n: int, seed: int, tau: float = 1.0):
    flat = teacher.reshape(-1, VOCAB)
    rows = sample_rows(flat, n, seed, 12345, torch.arange(flat.shape[0]), tau)
    k = rows.ids.shape[-1]
    lp = torch.gather(flat, 1, rows.ids)  # exact float64 teacher log-probs at the ids
    log_z = None if rows.log_normalizer is None else rows.log_normalizer.to(torch.float64)
    weights = sampled_target_weights(
        rows.counts, lp, proposal_temperature=tau, proposal_log_normalizer=log_z
    )
    shape = (*SHAPE, k)
    drawn = TeacherTargets(
        rows.ids.reshape(shape),
        lp.reshape(shape),
        sample_counts=rows.counts.reshape(shape),
        proposal_log_normalizer=None if log_z is None else log_z.reshape(SHAPE),
        proposal_temperature=tau,
    )
    return drawn, weights.reshape(shape)


def _oracle(logits, ids, weights, teacher_lp, mask, temperature):
    """float64 dense reference: sum_i w_i (log p_i - log q_i) per position, masked mean."""
    log_q = torch.log_softmax(logits.double() / temperature, -1)
    at = torch.gather(log_q, -1, ids.long())
    per = torch.where(weights > 0, weights.double() * (teacher_lp.double() - at), 0.0).sum(-1)
    return (per * mask).sum() / mask.sum()


@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_loss_and_gradient_match_the_float64_oracle(temperature: float, tau: float) -> None:
    teacher = _teacher()
    drawn, weights = _draw(teacher, 16, seed=7, tau=tau)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(*SHAPE, VOCAB, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = torch.rand(SHAPE, generator=g) > 0.2
    drawn.mask = mask
    options = LossOptions(temperature=temperature, chunk_size=5)
    loss, stats = topk_kl_loss(logits, drawn, options)
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    want = _oracle(ref_logits, drawn.ids, weights, drawn.logprobs, mask, temperature)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-9, atol=1e-12)
    assert math.isfinite(stats.loss)


def test_fused_path_matches_the_logits_path() -> None:
    teacher = _teacher(1)
    drawn, _ = _draw(teacher, 16, seed=3)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(*SHAPE, 17, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(VOCAB, 17, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    loss, _ = lm_head_topk_kl_loss(weight, hidden, drawn, LossOptions(chunk_size=7))
    loss.backward()
    h2, w2 = (
        hidden.detach().clone().requires_grad_(True),
        weight.detach().clone().requires_grad_(True),
    )
    want, _ = topk_kl_loss(h2 @ w2.T, drawn)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-9, atol=1e-12)


def test_no_host_sync_without_validation() -> None:
    teacher = _teacher(2)
    drawn, _ = _draw(teacher, 8, seed=1)
    drawn = drawn.apply(lambda t: t.float() if t.is_floating_point() else t)
    drawn.mask = torch.ones(SHAPE, dtype=torch.bool)
    logits = torch.randn(*SHAPE, VOCAB).requires_grad_(True)
    with NoHostSync():
        loss, _ = topk_kl_loss(logits, drawn, LossOptions(validate=False, chunk_size=9))
        loss.backward()


PAYLOADS = 1000  # M


def _draw_many(teacher: torch.Tensor, n: int, tau: float):
    """M independent payloads of the whole `SHAPE` at once, `[M, *SHAPE, K]`: payload `m`'s
    row `r` is drawn at counter position `m * R + r` (independent streams of one seed)."""
    flat = teacher.reshape(-1, VOCAB).repeat(PAYLOADS, 1)
    rows = sample_rows(flat, n, 11, 12345, torch.arange(flat.shape[0]), tau)
    lp = torch.gather(flat, 1, rows.ids)
    log_z = None if rows.log_normalizer is None else rows.log_normalizer.to(torch.float64)
    shape = (PAYLOADS, *SHAPE, n)
    return TeacherTargets(
        rows.ids.reshape(shape),
        lp.reshape(shape),
        sample_counts=rows.counts.reshape(shape),
        proposal_log_normalizer=None if log_z is None else log_z.reshape(shape[:-1]),
        proposal_temperature=tau,
    )


def _gradients(drawn: TeacherTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """The student logits `[*SHAPE, V]` and the `[M, C]` loss gradients w.r.t. them, one
    row per payload (one loss call over the M copies, `reduction="sum"`)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(*SHAPE, VOCAB, generator=g, dtype=torch.float64)
    logits = base.expand(drawn.ids.shape[0], *base.shape).clone().requires_grad_(True)
    loss, _ = topk_kl_loss(logits, drawn, LossOptions(reduction="sum"))
    loss.backward()
    assert logits.grad is not None
    return base, logits.grad.reshape(drawn.ids.shape[0], -1)


def _coordinates_and_projections(grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`grads` `[M, C]` -> itself and each position's projection on a fixed random unit
    direction, `[M, R]`."""
    rows = grads.reshape(grads.shape[0], -1, VOCAB)
    generator = torch.Generator().manual_seed(9)
    direction = torch.randn(rows.shape[1:], generator=generator, dtype=rows.dtype)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    return grads, (rows * direction).sum(-1)


class Errors(NamedTuple):
    """The unbiased estimator's standard errors `s / sqrt(M)` of the mean, per coordinate
    `[C]` and per projection `[R]`, and each coordinate's skewness of the mean
    `gamma / sqrt(M)` `[C]`."""

    coordinate: torch.Tensor
    projected: torch.Tensor
    skew: torch.Tensor


def _standard_errors(grads: torch.Tensor) -> Errors:
    m = grads.shape[0]
    coords, projected = _coordinates_and_projections(grads)
    centred = coords - coords.mean(0)
    skew = (centred**3).mean(0) / (centred**2).mean(0) ** 1.5
    root_m = math.sqrt(m)
    return Errors(coords.std(0) / root_m, projected.std(0) / root_m, skew / root_m)


def _z_scores(grads: torch.Tensor, truth: torch.Tensor, errors: Errors) -> tuple[float, float]:
    """`(max |z|, p-value)` of the mean gradient `[M, C]` against the truth `[C]`, with
    the unbiased estimator's standard `errors` (`_standard_errors`).

    `max |z|` over the coordinates, each `z` Johnson's skewness-corrected t-statistic
    `t + skew (1 + 2 t^2) / 6` (a rarely drawn id's weight is a skewed, Poisson-like
    variable: its plain t-statistic is biased by about `skew / 2` and heavy-tailed, which
    the normal bound does not allow for). The p-value: the coordinates of one position are
    dependent (a gradient row sums to 0), so their `sum z^2` is not chi-square; positions
    are independent, so each position's projection on a fixed random direction gives one
    z-score, and their `sum z^2` over the `R` positions is chi-square with `R` degrees of
    freedom.
    """
    (coords, projected), (truth_coords, truth_projected) = (
        _coordinates_and_projections(grads),
        _coordinates_and_projections(truth[None]),
    )
    t = (coords.mean(0) - truth_coords[0]) / errors.coordinate
    z = t + errors.skew * (1 + 2 * t**2) / 6
    z_rows = (projected.mean(0) - truth_projected[0]) / errors.projected
    r = z_rows.numel()
    p_value = float(torch.special.gammaincc(torch.tensor(r / 2.0), (z_rows**2).sum() / 2.0))
    return float(z.abs().max()), p_value


def _bonferroni(c: int) -> float:
    normal = torch.distributions.Normal(0.0, 1.0)
    return float(normal.icdf(torch.tensor(1.0 - ALPHA / (2 * c), dtype=torch.float64)))


@pytest.mark.parametrize("tau", [1.0, 1.5])
def test_mean_gradient_converges_to_the_full_forward_kl_gradient(tau: float) -> None:
    teacher = _teacher(3, scale=0.3)
    assert float(teacher.exp().min()) * PAYLOADS * 32 > 30  # each id drawn often: CLT holds
    base, grads = _gradients(_draw_many(teacher, 32, tau))
    truth = (torch.softmax(base, -1) - teacher.exp()).reshape(-1)  # d KL(p || q) / dz
    errors = _standard_errors(grads)
    assert float(errors.coordinate.min()) > 1e-6
    max_z, p_value = _z_scores(grads, truth, errors)
    bound = _bonferroni(truth.numel())
    assert max_z < bound, f"max |z| {max_z:.2f} >= {bound:.2f}"
    assert p_value > ALPHA, f"sum z^2: p = {p_value:.2e}"

    # the top-32 target (renormalized, deterministic) is biased: the same test fails
    top_lp, top_ids = teacher.topk(32, dim=-1)
    top_w = torch.softmax(top_lp, -1)
    ids, counts, lp = (t.expand(PAYLOADS, *t.shape) for t in (top_ids, top_w, top_lp))
    _, biased = _gradients(TeacherTargets(ids, lp, sample_counts=counts))
    max_z, p_value = _z_scores(biased, truth, errors)  # the unbiased estimator's errors
    assert max_z > bound and p_value < ALPHA


def test_refusals_name_the_option() -> None:
    teacher = _teacher()
    drawn, _ = _draw(teacher, 4, seed=0)
    logits = torch.randn(*SHAPE, VOCAB)

    def loss(teacher: TeacherTargets = drawn, **options: object) -> None:
        topk_kl_loss(logits, teacher, LossOptions(**options))  # type: ignore[arg-type]

    def changed(**fields: torch.Tensor) -> TeacherTargets:
        out = drawn.apply(lambda t: t)
        for name, value in fields.items():
            setattr(out, name, value)
        return out

    with pytest.raises(ValueError, match="divergence: the sampled loss supports 'forward' only"):
        loss(divergence="reverse")
    with pytest.raises(ValueError, match=r"divergence: .* got 'jsd'"):
        loss(divergence="jsd")
    with pytest.raises(ValueError, match="mode: 'tail_actual'"):
        loss(mode="tail_actual")
    with pytest.raises(ValueError, match="support: 'union' does not apply to the sampled loss"):
        loss(support="union")
    counts = drawn.sample_counts
    assert counts is not None
    with pytest.raises(ValueError, match=r"teacher\.sample_counts: must be finite and >= 0"):
        loss(changed(sample_counts=-counts))
    dup = drawn.ids.clone()
    dup[..., 1] = dup[..., 0]
    both = counts.clone()
    both[..., :2] = 2
    with pytest.raises(ValueError, match=r"teacher\.ids: a drawn id \(count > 0\) repeats"):
        loss(changed(ids=dup, sample_counts=both))
    with pytest.raises(ValueError, match=r"teacher\.sample_counts: must be a tensor shaped like"):
        loss(changed(sample_counts=counts[..., :2]))
    with pytest.raises(ValueError, match="proposal_log_normalizer"):
        sampled_target_weights(torch.ones(3, 4), proposal_temperature=2.0)


def test_top_k_loss_is_unchanged_by_the_shared_core() -> None:
    """A sampled teacher value whose counts are the whole distribution `p` is the full
    forward KL, as the top-k loss with K = V gives it."""
    teacher = _teacher(4)
    lp, ids = teacher.topk(VOCAB, dim=-1)
    logits = torch.randn(*SHAPE, VOCAB, dtype=torch.float64)
    a, _ = topk_kl_loss(logits, TeacherTargets(ids, lp), LossOptions(mode="truncated"))
    b, _ = topk_kl_loss(logits, TeacherTargets(ids, lp, sample_counts=lp.exp()))
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
