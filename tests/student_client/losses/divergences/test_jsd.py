"""The generalized JSD's convention (GKD / TRL): `m = beta p + (1 - beta) q`; `beta = 0`
is the forward KL, `beta = 1` the reverse KL, and near each endpoint JSD(beta) behaves as
that KL scaled by `beta` (resp. `1 - beta`). Its oracle, property, vocab-parallel and
no-sync tests run with the other divergences (`coarse_oracle.DIVERGENCE_CASES`)."""

from __future__ import annotations

import pytest
import torch

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    get_divergence,
    topk_kl_loss,
)


def _case():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=generator, dtype=torch.float64) * 2
    teacher = torch.log_softmax(
        torch.randn(6, 40, generator=generator, dtype=torch.float64) * 2, -1
    )
    logprobs, ids = teacher.topk(5, dim=-1)
    return logits, ids, logprobs


def _loss(divergence, mode="tail"):
    logits, ids, logprobs = _case()
    leaf = logits.clone().requires_grad_(True)
    loss, _ = topk_kl_loss(
        leaf,
        TeacherTargets(ids, logprobs),
        LossOptions(divergence=divergence, reduction="none", mode=mode),
    )
    loss.sum().backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize(("beta", "same_as"), [(0.0, "forward"), (1.0, "reverse")])
def test_endpoints_are_the_two_kls(beta: float, same_as: str) -> None:
    got, got_grad = _loss(get_divergence("jsd", beta=beta))
    want, want_grad = _loss(same_as)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("beta", "scale", "like"), [(1e-7, 1e-7, "forward"), (1 - 1e-7, 1e-7, "reverse")]
)
def test_near_the_endpoints_it_behaves_as_the_scaled_kl(
    beta: float, scale: float, like: str
) -> None:
    got, got_grad = _loss(get_divergence("jsd", beta=beta))
    want, want_grad = _loss(like)
    # The next order is beta**2 (p - q)**2 / q: small only where beta p / q is.
    torch.testing.assert_close(got / scale, want, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(got_grad / scale, want_grad, rtol=1e-4, atol=1e-8)


def test_beta_in_between_is_symmetric_at_one_half() -> None:
    """JSD(1/2) is symmetric in p̂, q̂: swapping the roles gives the same number (K = V)."""
    generator = torch.Generator().manual_seed(1)
    log_a = torch.log_softmax(torch.randn(3, 8, generator=generator, dtype=torch.float64), -1)
    log_b = torch.log_softmax(torch.randn(3, 8, generator=generator, dtype=torch.float64), -1)
    full = torch.arange(8).expand(3, 8)
    one = topk_kl_loss(
        log_a, TeacherTargets(full, log_b), LossOptions(divergence="jsd", reduction="none")
    )[0]
    other = topk_kl_loss(
        log_b, TeacherTargets(full, log_a), LossOptions(divergence="jsd", reduction="none")
    )[0]
    torch.testing.assert_close(one, other, rtol=1e-12, atol=1e-14)
    assert LossOptions(divergence="jsd").divergence == get_divergence("jsd", beta=0.5)


def test_beta_and_mode_errors_name_the_field() -> None:
    for beta in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match=r"^beta: must be a number in \[0, 1\]"):
            get_divergence("jsd", beta=beta)
    with pytest.raises(ValueError, match=r"^mode: 'truncated' applies to the forward KL only"):
        LossOptions(divergence="jsd", mode="truncated")
