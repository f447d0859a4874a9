"""The GPU benchmark's pieces on the CPU: each dense baseline is the same loss as the
library's path it is compared with, and every variant runs (the GPU-only timing and
memory calls are exercised on a GPU by `benchmarks/gpu/run.sh`)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.gpu import bench_losses_gpu as bench

N, V, K, H = 37, 301, 11, 24


@pytest.fixture
def teacher() -> bench.Inputs:
    return bench.make_teacher(N, V, K, torch.device("cpu"))


def test_the_candidates_have_every_kind(teacher: bench.Inputs) -> None:
    candidates = teacher["candidate_ids"]
    assert bool((candidates == -1).any())
    assert torch.equal(candidates[:, : bench.OVERLAP], teacher["ids"][:, : bench.OVERLAP])
    present = bench.union_present(teacher["ids"], candidates)
    assert present.shape == (N, K + bench.CANDIDATES)
    assert not bool(present[:, K : K + bench.OVERLAP].any())  # repeats of the top-k
    assert bool(present[:, K + bench.OVERLAP :].any())
    p = teacher["logprobs"].exp().sum(-1)
    assert bool((p < 1).all())  # a tail mass


@pytest.mark.parametrize("loss", bench.LOSSES)
def test_naive_baseline_equals_the_chunked_loss(teacher: bench.Inputs, loss: str) -> None:
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [logits.clone().requires_grad_(True) for _ in range(2)]
    naive = bench.loss_call(f"naive-{loss}", teacher)(leaves[0])
    chunked = bench.loss_call(f"chunked-{loss}", teacher)(leaves[1])
    naive.backward()
    chunked.backward()
    torch.testing.assert_close(naive.double(), chunked.double(), rtol=1e-6, atol=1e-9)
    assert leaves[0].grad is not None and leaves[1].grad is not None
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("variant", bench.LM_HEAD_VARIANTS)
def test_every_lm_head_variant_gives_the_same_loss(teacher: bench.Inputs, variant: str) -> None:
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64) * 0.3
    loss = "reverse-union" if variant.endswith("reverse-union") else variant.split("-")[-1]
    loss = "tail" if loss == "validate" else loss
    want = bench.loss_call(f"chunked-{loss}", teacher)(hidden @ weight.T)
    got = bench.loss_call(variant, teacher)(hidden, weight)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-9)


def test_markdown_lists_every_row_and_its_ratios() -> None:
    results = {
        "gpu": "G",
        "torch": "t",
        "cuda": "c",
        "grad_weight_gib": 1.0,
        "by_positions": {
            "8": {
                "logits_gib": 2.0,
                "floor": {"floor_ms": 10.0, "floor_tflops": 500.0},
                "rows": [
                    {"section": "lm_head", "variant": "fused-tail", "peak_gib": 1.5, "ms": 15.0},
                    {"section": "logits", "variant": "naive-tail", "error": "OutOfMemoryError"},
                ],
            }
        },
    }
    text = bench.markdown(results)
    assert "| lm_head | fused-tail | 1.50 | 0.75 | 15.0 | 1.50 |" in text
    assert "| logits | naive-tail | OutOfMemoryError |" in text
    assert "matmul floor 10.0 ms" in text and not math.isnan(results["grad_weight_gib"])
