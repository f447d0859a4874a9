"""The teacher columns' fp32 share of the fused loss's `grad_weight` (`split_columns`).

The pieces against direct float64 sums on odd shapes (owned masks, zero values, every batch
size), then the fused loss's bf16 `grad_weight` against the float64 oracle: with the
teacher columns summed in fp32 it loses less than the logits path with one chunk and stays
within 2x of it with 64 chunks (both fail when the teacher columns go through the rounded
running sum: equal with one chunk, 2.5x with 64).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from losses_oracle import oracle_loss

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.split_columns import column_entries, column_sums, zero_columns_

N_ROWS, HIDDEN, VOCAB, TOP_K = 47, 37, 123, 7


def _teacher_columns(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids per row `[N, K]` and a random owned mask."""
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:TOP_K] for _ in range(N_ROWS)])
    owned = torch.rand(N_ROWS, TOP_K, generator=generator) < 0.7
    return ids, owned


@pytest.mark.parametrize("use_owned", [False, True])
def test_zero_columns_zeroes_exactly_the_owned_teacher_columns(use_owned: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    ids, owned = _teacher_columns(generator)
    block = torch.randn(N_ROWS, VOCAB, generator=generator).to(torch.bfloat16)
    want = block.clone()
    for row in range(N_ROWS):
        for k in range(TOP_K):
            if not use_owned or owned[row, k]:
                want[row, ids[row, k]] = 0
    zero_columns_(block, ids, owned if use_owned else None)
    assert torch.equal(block, want)


@pytest.mark.parametrize("batch_columns", [1, 3, 1000])
def test_column_sums_equal_float64_sums_over_owned_nonzero_entries(batch_columns: int) -> None:
    generator = torch.Generator().manual_seed(2)
    ids, owned = _teacher_columns(generator)
    values = torch.randn(N_ROWS, TOP_K, generator=generator)
    values[::5] = 0  # e.g. rows that do not count
    hidden = torch.randn(N_ROWS, HIDDEN, generator=generator).to(torch.bfloat16)
    want = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    touched = set()
    for row in range(N_ROWS):
        for k in range(TOP_K):
            if owned[row, k] and values[row, k] != 0:
                want[ids[row, k]] += values[row, k].double() * hidden[row].double()
                touched.add(int(ids[row, k]))

    batches = list(column_sums(column_entries(ids, owned, values), hidden, batch_columns))
    assert all(len(columns) <= batch_columns for columns, _ in batches)
    columns = torch.cat([columns for columns, _ in batches])
    sums = torch.cat([sums for _, sums in batches])
    assert sums.dtype == torch.float32
    assert columns.tolist() == sorted(touched)  # ascending, each column once
    torch.testing.assert_close(sums.double(), want[columns], rtol=1e-6, atol=1e-6)


def test_no_entries_give_no_batches() -> None:
    ids = torch.zeros(3, 2, dtype=torch.int64)
    entries = column_entries(ids, None, torch.zeros(3, 2))
    assert list(column_sums(entries, torch.ones(3, 4), 8)) == []


def _problem() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(256, 48, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(300, 48, generator=generator) * 0.3).to(torch.bfloat16)
    teacher = torch.log_softmax(torch.randn(256, 300, generator=generator) * 3, -1)
    logprobs, ids = torch.topk(teacher, 8, dim=-1)
    return hidden, weight, ids, logprobs


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _weight_gradient(
    loss_of: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """d loss_of(w) / dw at `weight` (a fresh leaf)."""
    leaf = weight.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_of(leaf), leaf)
    assert grad.dtype == weight.dtype
    return grad


def test_bf16_grad_weight_loses_less_with_the_teacher_columns_in_fp32() -> None:
    hidden, weight, ids, logprobs = _problem()
    want = _weight_gradient(
        lambda w: oracle_loss(hidden.double() @ w.T, ids, logprobs, mode="tail"), weight.double()
    )
    logits_error = _relative_error(
        _weight_gradient(
            lambda w: topk_kl_loss(hidden @ w.T, TeacherTargets(ids, logprobs))[0], weight
        ),
        want,
    )
    errors = {
        chunk_size: _relative_error(
            _weight_gradient(
                lambda w, rows=chunk_size: lm_head_topk_kl_loss(
                    w, hidden, TeacherTargets(ids, logprobs), LossOptions(chunk_size=rows)
                )[0],
                weight,
            ),
            want,
        )
        for chunk_size in (None, 4)  # one chunk; 64 chunks
    }
    assert errors[None] < logits_error
    assert errors[4] < 2 * logits_error
