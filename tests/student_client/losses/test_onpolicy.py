"""The per-token on-policy signal (`losses/onpolicy.py`): the k1 / k2 / k3 estimators, the
stop-gradient advantage and the policy-gradient loss, with masks and unknown teacher
log-probs; k1 and k3 are unbiased estimators of KL(q || p) and the policy gradient with
the reverse-KL advantage is, in expectation over the student's samples, the reverse KL's
gradient (summed exactly over a small vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch

from student_client.losses.onpolicy import (
    kl_estimators,
    policy_gradient_loss,
    reverse_kl_advantage,
    sampled_token_logprobs,
)


def test_estimators_are_the_textbook_formulas_with_masks() -> None:
    student = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.1, -0.7]])
    teacher = torch.tensor([[-1.0, -1.5, math.nan], [-0.2, -0.1, -4.0]])
    mask = torch.tensor([[True, True, True], [False, True, True]])
    k1, k2, k3 = kl_estimators(student, teacher, mask)
    counted = torch.tensor([[True, True, False], [False, True, True]])  # NaN or masked: out
    r = torch.where(counted, student - teacher.nan_to_num(), torch.zeros(()))
    torch.testing.assert_close(k1, r)
    torch.testing.assert_close(k2, r**2 / 2)
    torch.testing.assert_close(k3, torch.exp(-r) - 1 + r)
    assert bool((k3 >= 0).all()) and bool((k1[~counted] == 0).all())
    advantage = reverse_kl_advantage(student.requires_grad_(True), teacher, mask)
    assert not advantage.requires_grad
    torch.testing.assert_close(advantage, -r)


def test_k1_and_k3_are_unbiased_for_the_reverse_kl() -> None:
    generator = torch.Generator().manual_seed(0)
    log_q = torch.log_softmax(torch.randn(12, generator=generator, dtype=torch.float64), -1)
    log_p = torch.log_softmax(torch.randn(12, generator=generator, dtype=torch.float64), -1)
    q = log_q.exp()
    reverse_kl = float((q * (log_q - log_p)).sum())
    # The exact expectation over y ~ q (enumerate the vocabulary).
    k1, k2, k3 = kl_estimators(log_q, log_p)
    assert float((q * k1).sum()) == reverse_kl
    torch.testing.assert_close(float((q * k3).sum()), reverse_kl, rtol=1e-12, atol=1e-12)
    assert float((q * k2).sum()) > 0


def test_policy_gradient_with_the_advantage_is_the_reverse_kl_gradient() -> None:
    """E_{y ~ q}[grad of -A(y) log q(y)] = grad KL(q || p), summed exactly over y."""
    generator = torch.Generator().manual_seed(1)
    vocab = 9
    logits = torch.randn(vocab, generator=generator, dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
    log_q = torch.log_softmax(logits, -1)
    (log_q.exp() * (log_q - log_p)).sum().backward()
    want = logits.grad.clone()
    logits.grad = None

    tokens = torch.arange(vocab)
    student = sampled_token_logprobs(logits.expand(vocab, vocab).double(), tokens)
    advantage = reverse_kl_advantage(student, log_p)
    weights = log_q.detach().exp()  # each y weighted by q(y): the exact expectation
    loss = policy_gradient_loss(
        student, advantage * weights * vocab, torch.ones(vocab, dtype=torch.bool)
    )
    loss.backward()
    torch.testing.assert_close(logits.grad, want, rtol=1e-10, atol=1e-12)


def test_policy_gradient_loss_ignores_masked_and_unknown_positions() -> None:
    student = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    advantage = torch.tensor([0.3, -0.2, 5.0])
    teacher = torch.tensor([-1.0, -2.0, math.nan])
    loss = policy_gradient_loss(student, advantage, torch.tensor([True, False, True]), teacher)
    assert float(loss.detach()) == pytest.approx(0.3)
    loss.backward()
    torch.testing.assert_close(student.grad, torch.tensor([-0.3, 0.0, 0.0]))
    empty = policy_gradient_loss(student, advantage, torch.zeros(3, dtype=torch.bool))
    assert float(empty.detach()) == 0.0
