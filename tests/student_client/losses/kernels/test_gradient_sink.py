"""How `lm_head_topk_kl_loss` sums `grad_weight` over row chunks (`grad_weight_accumulation`).

bf16 inputs against a float64 oracle on the same rounded inputs: the compensated and fp32
sums lose less than the weight-dtype sum (which rounds once per row chunk), all three equal
each other bitwise with a single chunk, and an fp32 weight ignores the choice.
"""

from __future__ import annotations

import pytest
import torch

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from tests.student_client.losses.calls import teacher_and_options
from tests.student_client.losses.losses_oracle import oracle_loss

ACCUMULATIONS = ("weight", "compensated", "float32")
N_ROWS, HIDDEN, VOCAB, TOP_K = 256, 48, 300, 8


def _problem(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(N_ROWS, HIDDEN, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3).to(dtype)
    teacher = torch.log_softmax(torch.randn(N_ROWS, VOCAB, generator=generator) * 3, -1)
    logprobs, ids = torch.topk(teacher, TOP_K, dim=-1)
    return hidden, weight, ids, logprobs


def _grad_weight(hidden, weight, ids, logprobs, **options) -> torch.Tensor:
    leaf = weight.clone().requires_grad_(True)
    loss, _ = lm_head_topk_kl_loss(leaf, hidden, *teacher_and_options(ids, logprobs, **options))
    loss.backward()
    assert leaf.grad is not None and leaf.grad.dtype == weight.dtype
    return leaf.grad


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def test_compensated_and_float32_lose_less_than_the_weight_dtype_sum() -> None:
    hidden, weight, ids, logprobs = _problem(torch.bfloat16)
    leaf = weight.double().requires_grad_(True)
    oracle_loss(hidden.double() @ leaf.T, ids, logprobs, mode="tail").backward()
    assert leaf.grad is not None
    want = leaf.grad
    logits_leaf = weight.clone().requires_grad_(True)
    topk_kl_loss(hidden @ logits_leaf.T, TeacherTargets(ids, logprobs))[0].backward()
    assert logits_leaf.grad is not None
    logits_error = _relative_error(logits_leaf.grad, want)  # one rounding of the sum
    errors = {
        accumulation: _relative_error(
            _grad_weight(
                hidden, weight, ids, logprobs, chunk_size=4, grad_weight_accumulation=accumulation
            ),
            want,
        )
        for accumulation in ACCUMULATIONS
    }
    # 64 chunks: 64 roundings of the running sum in bf16; the other two round each
    # chunk's product once and add exactly.
    assert errors["compensated"] < errors["weight"]
    assert errors["float32"] < errors["weight"]
    assert errors["compensated"] < 2 * logits_error
    assert errors["float32"] < 2 * logits_error
    assert errors["weight"] < 0.05  # still a few bf16 ulps


def test_one_chunk_gives_the_same_bits_whatever_the_accumulation() -> None:
    hidden, weight, ids, logprobs = _problem(torch.bfloat16)
    grads = [
        _grad_weight(hidden, weight, ids, logprobs, grad_weight_accumulation=accumulation)
        for accumulation in ACCUMULATIONS
    ]
    for grad in grads[1:]:
        assert torch.equal(grad, grads[0])


def test_float32_weight_ignores_the_choice() -> None:
    hidden, weight, ids, logprobs = _problem(torch.float32)
    grads = [
        _grad_weight(
            hidden, weight, ids, logprobs, chunk_size=16, grad_weight_accumulation=accumulation
        )
        for accumulation in ACCUMULATIONS
    ]
    for grad in grads[1:]:
        assert torch.equal(grad, grads[0])


def test_unknown_accumulation_names_the_argument() -> None:
    hidden, weight, ids, logprobs = _problem(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^grad_weight_accumulation: .*'weight'"):
        lm_head_topk_kl_loss(
            weight,
            hidden,
            TeacherTargets(ids, logprobs),
            LossOptions(grad_weight_accumulation="fp8"),
        )
