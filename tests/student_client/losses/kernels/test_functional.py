"""The chunked losses against a dense float64 oracle: values, gradients, bounds."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    topk_kl_loss,
    topk_kl_reference,
)
from student_client.losses.types import LossMode
from tests.student_client.losses.calls import teacher_and_options
from tests.student_client.losses.losses_oracle import (
    analytic_gradient,
    full_kl,
    make_case,
    oracle_loss,
    oracle_rows,
)

MODES: tuple[LossMode, ...] = ("tail", "truncated")


def _loss_and_grad(logits: torch.Tensor, ids, logprobs, **kwargs):
    leaf = logits.detach().clone().requires_grad_(True)
    loss, stats = topk_kl_loss(leaf, *teacher_and_options(ids, logprobs, **kwargs))
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad, stats


def _oracle_loss_and_grad(logits: torch.Tensor, ids, logprobs, **kwargs):
    leaf = logits.detach().double().requires_grad_(True)
    loss = oracle_loss(leaf, ids, logprobs, **kwargs)
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_float32_matches_oracle(mode: LossMode, temperature: float) -> None:
    case = make_case((6, 5), 97, 8, seed=1)
    loss, grad, _ = _loss_and_grad(
        case.logits,
        case.ids,
        case.logprobs,
        mode=mode,
        temperature=temperature,
        reduction="sum",
        chunk_size=4,
    )
    want_loss, want_grad = _oracle_loss_and_grad(
        case.logits, case.ids, case.logprobs, mode=mode, temperature=temperature, reduction="sum"
    )
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_oracle(mode: LossMode, dtype: torch.dtype) -> None:
    case = make_case((3, 47), 123, 16, seed=2, dtype=dtype)
    loss, grad, _ = _loss_and_grad(
        case.logits, case.ids, case.logprobs, mode=mode, reduction="sum", chunk_size=7
    )
    # The oracle sees the same (rounded) logits, so the loss differs by fp32 work only and
    # the gradient by one rounding to the logits' dtype.
    want_loss, want_grad = _oracle_loss_and_grad(
        case.logits, case.ids, case.logprobs, mode=mode, reduction="sum"
    )
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_odd_shape_per_position_terms(mode: LossMode) -> None:
    case = make_case((3, 47), 123, 5, seed=3)
    loss, _ = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode=mode, reduction="none", chunk_size=7),
    )
    want = oracle_rows(case.logits, case.ids, case.logprobs, mode=mode)
    assert loss.shape == (3, 47)
    torch.testing.assert_close(loss.double(), want["loss"].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_spec_closed_form_gradient_equals_autograd_on_oracle(
    mode: LossMode, temperature: float
) -> None:
    case = make_case((4, 3), 31, 6, seed=4, dtype=torch.float64)
    _, autograd = _oracle_loss_and_grad(
        case.logits,
        case.ids,
        case.logprobs,
        mode=mode,
        temperature=temperature,
        reduction="sum",
    )
    closed_form = analytic_gradient(
        case.logits, case.ids, case.logprobs, mode=mode, temperature=temperature
    )
    torch.testing.assert_close(autograd, closed_form, rtol=1e-10, atol=1e-12)
    _, chunked, _ = _loss_and_grad(
        case.logits,
        case.ids,
        case.logprobs,
        mode=mode,
        temperature=temperature,
        reduction="sum",
    )
    torch.testing.assert_close(chunked, closed_form, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_float64_gradcheck(mode: LossMode) -> None:
    case = make_case((5,), 13, 4, seed=5, dtype=torch.float64)
    logits = case.logits.clone().requires_grad_(True)

    def loss_of(z: torch.Tensor) -> torch.Tensor:
        loss, _ = topk_kl_loss(
            z,
            TeacherTargets(case.ids, case.logprobs),
            LossOptions(mode=mode, temperature=0.8, chunk_size=2),
        )
        return loss

    assert torch.autograd.gradcheck(loss_of, (logits,), eps=1e-6, atol=1e-8)


def test_tail_mode_equals_full_kl_when_k_is_vocab() -> None:
    case = make_case((4, 6), 29, 29, seed=6)
    loss, stats = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="tail", reduction="none", overlap=True),
    )
    want = full_kl(case.logits, case.teacher_full)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    assert stats.overlap == pytest.approx(1.0)
    assert stats.teacher_mass == pytest.approx(1.0, abs=1e-6)
    assert stats.student_mass == pytest.approx(1.0, abs=1e-6)


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab=st.integers(2, 40),
    k_fraction=st.floats(0.05, 1.0),
    student_scale=st.floats(0.1, 8.0),
    teacher_scale=st.floats(0.1, 8.0),
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
)
def test_tail_mode_between_zero_and_full_kl(
    seed: int,
    vocab: int,
    k_fraction: float,
    student_scale: float,
    teacher_scale: float,
    temperature: float,
) -> None:
    top_k = max(1, min(vocab, round(vocab * k_fraction)))
    case = make_case(
        (6,),
        vocab,
        top_k,
        seed=seed,
        student_scale=student_scale,
        teacher_scale=teacher_scale,
    )
    loss, _ = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="tail", reduction="none", temperature=temperature),
    )
    upper = full_kl(case.logits, case.teacher_full, temperature=temperature)
    slack = 1e-5 * (1.0 + upper.abs())
    assert bool((loss.double() >= -slack).all()), loss
    assert bool((loss.double() <= upper + slack).all()), (loss, upper)


def test_truncated_mode_can_be_negative() -> None:
    # Student puts more mass on the teacher's top-k than the teacher: Q > P.
    case = make_case((8,), 50, 5, seed=7, teacher_scale=0.2)
    student = torch.full((8, 50), -5.0).scatter_(1, case.ids, 5.0)
    loss, stats = topk_kl_loss(
        student,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="truncated", reduction="none"),
    )
    assert bool((loss < 0).all())
    assert stats.student_mass > stats.teacher_mass
    tail_loss, _ = topk_kl_loss(
        student, TeacherTargets(case.ids, case.logprobs), LossOptions(mode="tail", reduction="none")
    )
    assert bool((tail_loss >= 0).all())


def test_student_tail_keeps_precision_when_kept_mass_rounds_to_one() -> None:
    # 1 - Q = 1 / (1 + e^16) ~ 1.1e-7 per row: formed as 1 - sum(q) in fp32 it would round to
    # a multiple of 6e-8 or to 0 (then the 1e-6 guard would take over and the tail term
    # would be off by ~25%). The chunked pass sums the tail directly instead.
    vocab, top_k = 2048, 1024
    logits = torch.zeros(2, vocab)
    logits[:, :top_k] = 16.0
    ids = torch.arange(top_k).repeat(2, 1)
    logprobs = torch.full((2, top_k), -math.log(top_k) - 1e-3)
    loss, grad, stats = _loss_and_grad(logits, ids, logprobs, mode="tail", reduction="sum")
    want_loss, want_grad = _oracle_loss_and_grad(
        logits, ids, logprobs.double(), mode="tail", reduction="sum"
    )
    want = oracle_rows(logits.double(), ids, logprobs.double(), mode="tail")
    assert stats.tail_loss == pytest.approx(float(want["tail"].mean()), rel=1e-5)
    # The head part is a difference of two ~6.9 numbers: fp32 leaves ~1e-6 there.
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_dense_reference_matches_oracle(mode: LossMode) -> None:
    case = make_case((5, 4), 61, 7, seed=8)
    rows = topk_kl_reference(
        case.logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode=mode, temperature=1.3),
    )
    want = oracle_rows(case.logits, case.ids, case.logprobs, mode=mode, temperature=1.3)
    for name in ("loss", "head", "tail", "teacher_mass", "student_mass", "overlap"):
        torch.testing.assert_close(
            getattr(rows, name).detach(), want[name].detach(), rtol=1e-9, atol=1e-12
        )


@pytest.mark.parametrize("mode", MODES)
def test_stats_match_oracle(mode: LossMode) -> None:
    case = make_case((9, 4), 40, 6, seed=9)
    mask = torch.rand(9, 4, generator=torch.Generator().manual_seed(1)) > 0.3
    _, stats = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs, mask=mask),
        LossOptions(mode=mode, overlap=True),
    )
    want = oracle_rows(case.logits, case.ids, case.logprobs, mode=mode)
    counted = mask.double()

    def mean(values: torch.Tensor) -> float:
        return float((values.detach() * counted).sum() / counted.sum())

    assert stats.positions == int(mask.sum())
    assert stats.loss == pytest.approx(mean(want["loss"]), rel=1e-5)
    assert stats.head_loss == pytest.approx(mean(want["head"]), rel=1e-5)
    assert stats.tail_loss == pytest.approx(mean(want["tail"]), rel=1e-5)
    assert stats.teacher_mass == pytest.approx(mean(want["teacher_mass"]), rel=1e-5)
    assert stats.student_mass == pytest.approx(mean(want["student_mass"]), rel=1e-5)
    assert stats.overlap == pytest.approx(mean(want["overlap"]), rel=1e-6)
    assert stats.clamped_fraction == 0.0
