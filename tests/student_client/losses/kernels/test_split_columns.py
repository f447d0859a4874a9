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

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.kernels.split_columns import (
    add_column_sums_,
    column_entries,
    column_sums,
    zero_columns_,
)
from tests.student_client.losses.losses_oracle import oracle_loss

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


def _float64_sums(
    ids: torch.Tensor, owned: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Per column: `sum values * hidden[row]` over its owned, nonzero entries, float64."""
    want: dict[int, torch.Tensor] = {}
    for row in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if owned[row, k] and values[row, k] != 0:
                column = int(ids[row, k])
                term = values[row, k].double() * hidden[row].double()
                want[column] = want.get(column, 0) + term
    return want


def _repeated_columns(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids per row `[N, K]` where id 5 is in every row and id 9 in every other
    one, so that columns span several batches; a random owned mask."""
    others = torch.tensor([i for i in range(VOCAB) if i not in (5, 9)])
    rows = [others[torch.randperm(len(others), generator=generator)[:TOP_K]] for _ in range(N_ROWS)]
    ids = torch.stack(rows)
    ids[:, 0] = 5
    ids[::2, 1] = 9
    owned = torch.rand(N_ROWS, TOP_K, generator=generator) < 0.7
    return ids, owned


@pytest.mark.parametrize("batch_entries", [1, 3, 40, 47 * 7, 10_000])
def test_column_sums_equal_float64_sums_over_owned_entries(batch_entries: int) -> None:
    generator = torch.Generator().manual_seed(2)
    ids, owned = _repeated_columns(generator)
    assert all(len(set(row.tolist())) == TOP_K for row in ids)  # distinct within a row
    values = torch.randn(N_ROWS, TOP_K, generator=generator)
    values[::5] = 0  # e.g. rows that do not count
    hidden = torch.randn(N_ROWS, HIDDEN, generator=generator).to(torch.bfloat16)
    want = _float64_sums(ids, owned, values, hidden)

    got: dict[int, torch.Tensor] = {}
    for batch in column_sums(column_entries(ids, owned, values), hidden, batch_entries):
        assert batch.sums.dtype == torch.float32
        assert batch.columns.shape[0] <= batch_entries
        if not bool(batch.complete):
            continue
        for column, total in zip(batch.columns.tolist(), batch.sums, strict=True):
            if column in got:  # a repeated slot: the same column, the same sum
                assert torch.equal(got[column], total)
            got[column] = total
    assert set(got) >= set(want)  # every column with an entry, each complete once
    for column, total in got.items():
        expected = want.get(column, torch.zeros(HIDDEN, dtype=torch.float64))
        torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_entries", [1, 4, 1000])
@pytest.mark.parametrize("compensated", [False, True])
def test_add_column_sums_rounds_each_column_once(batch_entries: int, compensated: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    ids, owned = _repeated_columns(generator)
    values = torch.randn(N_ROWS, TOP_K, generator=generator)
    hidden = torch.randn(N_ROWS, HIDDEN, generator=generator).to(torch.bfloat16)
    grad_weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16)
    low = (torch.randn(VOCAB, HIDDEN, generator=generator) * 1e-3).to(torch.bfloat16)
    start = grad_weight.double() + (low.double() if compensated else 0)
    want = start.clone()
    for column, total in _float64_sums(ids, owned, values, hidden).items():
        want[column] += total
    before = grad_weight.clone()
    compensation = low.clone() if compensated else None
    entries = column_entries(ids, owned, values)
    add_column_sums_(grad_weight, entries, hidden, batch_entries, compensation)
    touched = sorted({int(i) for i in ids.reshape(-1)})  # not-owned entries add 0 there
    untouched = [c for c in range(VOCAB) if c not in touched]
    # Columns with an entry: the fp32 sum rounded once; the others exactly as they were.
    rounded_once = want[touched].to(torch.bfloat16).double()
    torch.testing.assert_close(grad_weight[touched].double(), rounded_once, rtol=8e-3, atol=1e-5)
    assert torch.equal(grad_weight[untouched], before[untouched])
    if compensation is not None:
        assert bool((compensation[touched] == 0).all())
        assert torch.equal(compensation[untouched], low[untouched])


def test_no_entries_give_no_batches() -> None:
    ids = torch.zeros(0, 2, dtype=torch.int64)
    entries = column_entries(ids, None, torch.zeros(0, 2))
    assert list(column_sums(entries, torch.ones(0, 4), 8)) == []


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
