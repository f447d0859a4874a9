"""Every loss path on a GPU against the float64 oracles, at a size where GPU kernels differ
from the CPU's (N = 512, V = 32,768, K = 128): the chunked logits path and the fused lm_head
path, tail and truncated forward KL, reverse KL on the union support, float32 and bf16.

The tolerances are the CPU suite's for the same comparison (named beside each). Skipped,
saying so, where no CUDA device is present; a GPU machine runs this file as it is
(`benchmarks/gpu/run.sh`). The no-host-sync checks run under CUDA in `test_no_host_sync.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from coarse_oracle import reference_rows
from losses_oracle import make_case, oracle_loss
from support_cases import make_candidates

from student_client.losses import LossOptions, TeacherTargets, lm_head_topk_kl_loss, topk_kl_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

N, V, K, H, C = 512, 32_768, 128, 256, 64
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _exact_float32_matmuls() -> Iterator[None]:
    """float32 matmuls in full precision (no TF32), as on the CPU."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _teacher(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student logits `[N, V]` (float64), teacher ids / log-probs `[N, K]`, teacher full
    log-probs `[N, V]`, on the CPU."""
    case = make_case((N,), V, K, seed=seed, dtype=torch.float64, teacher_scale=2.0)
    return case.logits, case.ids, case.logprobs, case.teacher_full


def _mask(seed: int) -> torch.Tensor:
    return torch.rand(N, generator=torch.Generator().manual_seed(seed)) > 0.3


def _linear(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states `[N, H]` and an lm_head weight `[V, H]` in `dtype`, on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64) * (2.0 / H**0.5)
    return hidden.to(dtype).cuda(), weight.to(dtype).cuda()


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    assert leaf.grad is not None
    return leaf.grad.double()


# ------------------------------------------------------------ forward KL, tail / truncated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["tail", "truncated"])
def test_logits_path_matches_the_oracle(mode: str, dtype: torch.dtype) -> None:
    logits64, ids, logprobs, _ = _teacher(1)
    mask = _mask(1).cuda()
    leaf = logits64.to(dtype).cuda().requires_grad_(True)
    loss, stats = topk_kl_loss(
        leaf, TeacherTargets(ids.cuda(), logprobs.cuda(), mask=mask), LossOptions(mode=mode)
    )
    loss.backward()
    reference = leaf.detach().double().requires_grad_(True)  # the same (rounded) values
    want = oracle_loss(reference, ids.cuda(), logprobs.cuda(), mode=mode, mask=mask)
    want.backward()
    # test_topk_kl (float32) and test_support's bf16 logits case.
    loss_rtol, grad_rtol, grad_atol = (
        (1e-5, 1e-5, 1e-7) if dtype == torch.float32 else (1e-5, 1e-2, 2e-8)
    )
    torch.testing.assert_close(loss.double(), want.detach(), rtol=loss_rtol, atol=1e-6)
    torch.testing.assert_close(_grad(leaf), _grad(reference), rtol=grad_rtol, atol=grad_atol)
    assert stats.positions == int(mask.sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("mode", ["tail", "truncated"])
def test_fused_path_matches_the_oracle(
    mode: str, grad_in_forward: bool, dtype: torch.dtype
) -> None:
    _, ids, logprobs, _ = _teacher(2)
    mask = _mask(2).cuda()
    hidden, weight = _linear(3, dtype)
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    loss, stats = lm_head_topk_kl_loss(
        leaves[1],
        leaves[0],
        TeacherTargets(ids.cuda(), logprobs.cuda(), mask=mask),
        LossOptions(mode=mode, grad_in_forward=grad_in_forward),
    )
    loss.backward()
    references = [t.double().requires_grad_(True) for t in (hidden, weight)]  # same inputs
    want = oracle_loss(
        references[0] @ references[1].T, ids.cuda(), logprobs.cuda(), mode=mode, mask=mask
    )
    want.backward()
    # kernels/test_fused.test_low_precision_inputs_match_oracle.
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (3e-2, 1e-2)
    torch.testing.assert_close(loss.double(), want.detach(), rtol=rtol, atol=atol)
    for leaf, reference in zip(leaves, references, strict=True):
        scale = float(_grad(reference).abs().max())
        torch.testing.assert_close(_grad(leaf), _grad(reference), rtol=rtol, atol=atol * scale)
    assert stats.positions == int(mask.sum())


# ------------------------------------------------------------ reverse KL, union support


def _union_problem(seed: int) -> dict[str, torch.Tensor]:
    """Logits, the teacher's top-k and the student's candidates of every kind
    (`support_cases`), on the CPU."""
    logits64, ids, logprobs, teacher_full = _teacher(seed)
    candidate_ids, candidate_logprobs = make_candidates(logits64, ids, teacher_full, C, seed=seed)
    return {
        "logits": logits64,
        "ids": ids,
        "logprobs": logprobs,
        "candidate_ids": candidate_ids,
        "candidate_logprobs": candidate_logprobs,
        "mask": _mask(seed),
    }


def _union_reference(logits64: torch.Tensor, problem: dict[str, torch.Tensor]) -> torch.Tensor:
    """The coarse oracle's masked mean (float64, on the CPU; differentiable)."""
    rows = reference_rows(
        logits64,
        problem["ids"],
        problem["logprobs"],
        divergence="reverse",
        mode="tail",
        support="union",
        candidate_ids=problem["candidate_ids"],
        candidate_logprobs=problem["candidate_logprobs"],
    )
    weight = problem["mask"].double()
    return (rows * weight).sum() / weight.sum()


def _union_teacher(problem: dict[str, torch.Tensor]) -> TeacherTargets:
    return TeacherTargets(
        problem["ids"].cuda(),
        problem["logprobs"].cuda(),
        mask=problem["mask"].cuda(),
        candidate_ids=problem["candidate_ids"].cuda(),
        candidate_logprobs=problem["candidate_logprobs"].cuda(),
    )


UNION = LossOptions(divergence="reverse", support="union")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_kl_on_the_union_logits_path(dtype: torch.dtype) -> None:
    problem = _union_problem(4)
    leaf = problem["logits"].to(dtype).cuda().requires_grad_(True)
    loss, _ = topk_kl_loss(leaf, _union_teacher(problem), UNION)
    loss.backward()
    reference = leaf.detach().double().cpu().requires_grad_(True)
    want = _union_reference(reference, problem)
    want.backward()
    # test_support: test_logits_path_matches_the_reference / test_logits_path_bf16.
    loss_rtol, grad_rtol = (2e-6, 1e-4) if dtype == torch.float32 else (1e-5, 1e-2)
    torch.testing.assert_close(loss.double().cpu(), want.detach(), rtol=loss_rtol, atol=1e-7)
    torch.testing.assert_close(_grad(leaf).cpu(), _grad(reference), rtol=grad_rtol, atol=2e-8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_kl_on_the_union_fused_path(dtype: torch.dtype) -> None:
    problem = _union_problem(5)
    hidden, weight = _linear(6, dtype)
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    loss, _ = lm_head_topk_kl_loss(leaves[1], leaves[0], _union_teacher(problem), UNION)
    loss.backward()
    references = [t.double().cpu().requires_grad_(True) for t in (hidden, weight)]
    logits64 = references[0] @ references[1].T
    if dtype == torch.bfloat16:  # the fused loss rounds its logits block to bf16 once
        logits64 = logits64 + (logits64.to(dtype).double() - logits64).detach()
    want = _union_reference(logits64, problem)
    want.backward()
    # test_support.test_fused_path_matches_the_reference.
    rtol, grad_rtol, grad_atol = (
        (1e-5, 1e-4, 1e-6) if dtype == torch.float32 else (1e-5, 3e-2, 1e-2)
    )
    torch.testing.assert_close(loss.double().cpu(), want.detach(), rtol=rtol, atol=rtol * 1e-2)
    for leaf, reference in zip(leaves, references, strict=True):
        scale = float(_grad(reference).abs().max())
        torch.testing.assert_close(
            _grad(leaf).cpu(), _grad(reference), rtol=grad_rtol, atol=grad_atol * scale
        )
