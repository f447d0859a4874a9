"""The reverse-KL advantage of the sampled tokens: the definition on a hand example, the
mask and the last position, no gradient, and shape errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from student_client.losses.sampled_advantage import reverse_kl_advantage, sampled_token_logprobs


def test_sampled_token_logprobs_match_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    got = sampled_token_logprobs(logits, tokens)
    logp = torch.log_softmax(logits, -1)
    for b in range(2):
        for t in range(4):
            assert got[b, t] == pytest.approx(float(logp[b, t, tokens[b, t + 1]]), abs=1e-6)
    assert torch.isnan(got[:, -1]).all()


def test_advantage_is_teacher_minus_student_without_gradient() -> None:
    student = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, float("nan")]])
    adv = reverse_kl_advantage(student, teacher)
    assert adv.tolist() == [[0.5, -1.0, 0.0]] and not adv.requires_grad
    masked = reverse_kl_advantage(student, teacher, torch.tensor([[False, True, True]]))
    assert masked.tolist() == [[0.0, -1.0, 0.0]]


def test_shape_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="student_logprobs, teacher_logprobs"):
        reverse_kl_advantage(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask: shape"):
        reverse_kl_advantage(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="logits, tokens"):
        sampled_token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4))
