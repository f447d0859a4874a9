"""The on-policy metric (`examples/onpolicy_eval.py`): the per-position KL(student ||
teacher) against a plain float64 reference at an odd shape, zero for equal
distributions, and the sampled metric deterministic, zero for a student that is the
teacher, and leaving the caller's random state alone."""

from __future__ import annotations

import math

import pytest
import torch

from examples.distill import DistillConfig, student_model
from examples.onpolicy_eval import kl_student_teacher, onpolicy_kl


def _reference(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """sum_v q (log q - log p), one position at a time, in float64."""
    out = torch.empty(student.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in student.shape[:-1])):
        s = student[tuple(idx)].double()
        t = teacher[tuple(idx)].double()
        q = s.exp() / s.exp().sum()
        p = t.exp() / t.exp().sum()
        out[tuple(idx)] = (q * (q / p).log()).sum()
    return out


def test_kl_matches_a_float64_reference_at_an_odd_shape() -> None:
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 47, 123, generator=g) * 3
    teacher = torch.randn(3, 47, 123, generator=g) * 2 + 1  # a shift changes nothing
    got = kl_student_teacher(student, teacher)
    assert got.shape == (3, 47) and got.dtype == torch.float32
    want = _reference(student, teacher)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got >= 0).all()


def test_kl_of_a_distribution_with_itself_is_zero() -> None:
    logits = torch.randn(3, 47, 123, generator=torch.Generator().manual_seed(1)) * 4
    assert kl_student_teacher(logits, logits).abs().max() < 1e-5
    # The same distribution from shifted logits, and in bfloat16 input.
    assert kl_student_teacher(logits, logits + 7.0).abs().max() < 1e-4
    half = logits.bfloat16()
    assert kl_student_teacher(half, half).abs().max() < 1e-5


def test_kl_refuses_different_shapes() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        kl_student_teacher(torch.zeros(2, 3, 5), torch.zeros(2, 3, 6))


def test_onpolicy_kl_is_deterministic_and_zero_for_the_teacher_itself() -> None:
    torch.manual_seed(0)
    vocab = 300
    student = student_model(vocab, DistillConfig(hidden_size=16, seed=0)).eval()
    teacher = student_model(vocab, DistillConfig(hidden_size=16, seed=1)).eval()
    prompts = torch.randint(0, 256, (5, 7), generator=torch.Generator().manual_seed(2))
    state = torch.random.get_rng_state()
    first = onpolicy_kl(student, teacher, prompts, response=6, batch=2)
    assert torch.equal(torch.random.get_rng_state(), state)  # its own seed, not the caller's
    assert onpolicy_kl(student, teacher, prompts, response=6, batch=2) == first
    assert first > 0.0 and math.isfinite(first)
    assert abs(onpolicy_kl(teacher, teacher, prompts, response=6, batch=2)) < 1e-6
    assert not student.training  # its mode is restored
