"""Chunking, offsets, empty input and memory-shape properties of the chunked loss."""

from __future__ import annotations

import pytest
import torch

from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
from student_client.losses.kernels.chunked import chunked_topk_kl
from student_client.losses.kernels.settings import ChunkedSettings
from student_client.losses.parallel import VocabShard
from student_client.losses.sizing import DEFAULT_CHUNK_BYTES, auto_chunk_rows
from student_client.losses.types import LossMode, Reduction
from tests.student_client.losses.calls import teacher_and_options
from tests.student_client.losses.losses_oracle import make_case, oracle_loss

MODES: tuple[LossMode, ...] = ("tail", "truncated")


def _run(logits: torch.Tensor, ids, logprobs, **kwargs):
    leaf = logits.detach().clone().requires_grad_(True)
    loss, stats = topk_kl_loss(leaf, *teacher_and_options(ids, logprobs, **kwargs))
    loss.sum().backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad, stats


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_sizes_give_identical_results(mode: LossMode, dtype: torch.dtype) -> None:
    case = make_case((3, 47), 123, 6, seed=11, dtype=dtype)
    mask = torch.rand(3, 47, generator=torch.Generator().manual_seed(2)) > 0.2
    n_rows = 3 * 47
    results = [
        _run(
            case.logits,
            case.ids,
            case.logprobs,
            mode=mode,
            mask=mask,
            reduction="none",
            temperature=0.9,
            chunk_size=chunk,
        )
        for chunk in (1, 7, 64, n_rows, n_rows + 5, None)
    ]
    first_loss, first_grad, first_stats = results[0]
    for loss, grad, stats in results[1:]:
        assert torch.equal(loss, first_loss)
        assert torch.equal(grad, first_grad)
        assert stats == first_stats


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_offset_invariance_at_two_to_the_twenty(mode: LossMode, temperature: float) -> None:
    case = make_case((4, 9), 301, 12, seed=12, dtype=torch.float64)
    # Logits on a 1/8 grid, so that logits + 2**20 is exact in float32.
    logits = (case.logits * 8).round().div(8).float()
    shifted = logits + 2.0**20
    assert torch.equal(shifted - 2.0**20, logits)
    kwargs = {"mode": mode, "temperature": temperature, "reduction": "sum", "chunk_size": 5}
    loss, grad, stats = _run(logits, case.ids, case.logprobs, **kwargs)
    loss_shifted, grad_shifted, stats_shifted = _run(shifted, case.ids, case.logprobs, **kwargs)
    assert torch.equal(loss_shifted, loss)
    assert torch.equal(grad_shifted, grad)
    assert stats_shifted == stats
    want = oracle_loss(
        logits, case.ids, case.logprobs, mode=mode, temperature=temperature, reduction="sum"
    )
    torch.testing.assert_close(loss_shifted.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_input_gives_zero_loss_that_backpropagates(
    mode: LossMode, reduction: Reduction
) -> None:
    logits = torch.randn(0, 50, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(0, 4, dtype=torch.int32)
    logprobs = torch.zeros(0, 4)
    loss, stats = topk_kl_loss(
        logits, TeacherTargets(ids, logprobs), LossOptions(mode=mode, reduction=reduction)
    )
    assert loss.requires_grad
    assert loss.shape == (() if reduction != "none" else (0,))
    assert float(loss.detach().sum()) == 0.0
    loss.sum().backward()
    assert logits.grad is not None
    assert logits.grad.shape == (0, 50)
    assert stats.positions == 0
    assert stats.loss == 0.0


def test_empty_batch_dimension_with_positions_shape() -> None:
    logits = torch.randn(2, 0, 30, requires_grad=True)
    loss, _ = topk_kl_loss(
        logits, TeacherTargets(torch.zeros(2, 0, 3, dtype=torch.long), torch.zeros(2, 0, 3))
    )
    loss.backward()
    assert logits.grad is not None
    assert logits.grad.shape == (2, 0, 30)
    assert float(loss.detach()) == 0.0


def test_auto_chunk_rows_follows_budget() -> None:
    assert auto_chunk_rows(32768) == DEFAULT_CHUNK_BYTES // (32768 * 4)
    assert auto_chunk_rows(10**9) == 1
    assert auto_chunk_rows(1000, budget_bytes=8000) == 2


def test_gradient_has_logits_dtype_and_no_graph_through_vocab() -> None:
    case = make_case((5,), 40, 4, seed=13, dtype=torch.bfloat16)
    logits = case.logits.clone().requires_grad_(True)
    loss, _ = topk_kl_loss(logits, TeacherTargets(case.ids, case.logprobs))
    # One custom node between the logits and the loss; nothing of [N, V] size is saved by
    # autograd except the logits themselves.
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = topk_kl_loss(logits, TeacherTargets(case.ids, case.logprobs))
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1
    assert big[0].dtype == torch.bfloat16
    assert big[0].data_ptr() == logits.data_ptr()
    loss.backward()
    assert logits.grad is not None
    assert logits.grad.dtype == torch.bfloat16


def test_kernel_returns_the_reduced_loss_and_per_position_terms() -> None:
    case = make_case((6,), 30, 3, seed=14)
    settings = ChunkedSettings(LossOptions(), VocabShard.from_group(None, 30), chunk_rows=4)
    counted = torch.tensor([True, True, False, True, True, True])
    logits = case.logits.detach().requires_grad_()
    result = chunked_topk_kl(logits, case.ids, case.logprobs, counted, settings)
    rows, clamped = result.rows, result.clamped
    assert all(value.shape == (6,) for value in rows)
    assert clamped.shape == (6,) and not clamped.any()  # no clamp_min: none clamped
    torch.testing.assert_close(rows.loss, rows.head + rows.tail)
    assert not rows.loss.requires_grad and not rows.head.requires_grad
    # "mean" over the counted rows, as masking.reduce_positions gives it
    torch.testing.assert_close(result.loss, rows.loss[counted].mean())
    assert result.loss.requires_grad


def test_chunk_sizes_agree_to_rounding_for_rows_longer_than_torch_grain() -> None:
    # torch splits a single long row's sum over threads (above 32768 elements), so chunks
    # of 1 row may differ from wider chunks in the last bits; no more than that.
    case = make_case((6,), 40_000, 16, seed=15)
    results = [
        _run(case.logits, case.ids, case.logprobs, reduction="none", chunk_size=chunk)
        for chunk in (1, 4, 6)
    ]
    for loss, grad, _ in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=2e-6, atol=1e-12)
