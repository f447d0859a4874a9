"""With `validate=False` neither loss waits for the device: no host sync in forward or backward.

A `TorchDispatchMode` sees every aten op of the call and fails on the ones that copy a
device value to the host (`_local_scalar_dense`, behind `.item()`, `.tolist()`, `bool()`),
on `nonzero` / `masked_select` (whose output size depends on the data) and on boolean-mask
indexing (which calls `nonzero`). The stats are read only after the mode is left.

Each test runs on the CPU and, where CUDA is available, on the GPU, where the guard also
arms CUDA's own sync check (`host_sync.py`): a GPU machine runs this file as it is
(`benchmarks/gpu/run.sh`); elsewhere the CUDA cases are skipped, saying so.
"""

from __future__ import annotations

import math

import pytest
import torch
from host_sync import NoHostSync

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from tests.student_client.losses.calls import teacher_and_options

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]
SYNC_ERRORS = (AssertionError, RuntimeError)  # the dispatch mode's, CUDA's sync check's
SYNC_MESSAGE = r"host sync|boolean-mask|synchronizing CUDA operation"


@pytest.mark.parametrize("device", DEVICES)
def test_the_guard_catches_syncs(device: str) -> None:
    values = torch.randn(5, device=device)
    syncs = [
        lambda: values.sum().item(),
        lambda: float(values.sum()),
        lambda: bool((values > 0).any()),
        lambda: values[values > 0],
        lambda: values.nonzero(),
    ]
    # (`.tolist()` of a CPU tensor reads its memory without any aten op; on a GPU it is a
    # device-to-host copy, which CUDA's sync check catches.)
    if device == "cuda":
        syncs += [lambda: values.tolist(), lambda: values.cpu(), torch.cuda.synchronize]
    for sync in syncs:
        with pytest.raises(SYNC_ERRORS, match=SYNC_MESSAGE), NoHostSync():
            sync()


def _problem(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 9, 16, generator=generator).to(dtype)
    weight = (torch.randn(50, 16, generator=generator) * 0.5).to(dtype)
    teacher = torch.log_softmax(torch.randn(4, 9, 50, generator=generator) * 2, -1)
    logprobs, ids = teacher.topk(6, dim=-1)
    mask = torch.rand(4, 9, generator=generator) > 0.3
    tensors = (hidden, weight, ids.int(), logprobs.half(), mask)
    return tuple(tensor.to(device) for tensor in tensors)


OPTIONS = [
    {"mode": "tail", "reduction": "mean"},
    {"mode": "truncated", "reduction": "sum", "clamp_min": 0.0, "temperature": 1.3},
    {"mode": "tail", "reduction": "none", "overlap": True},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS)
def test_topk_kl_loss_does_not_sync(options, device) -> None:
    hidden, weight, ids, logprobs, mask = _problem(device=device)
    logits = (hidden @ weight.T).requires_grad_(True)
    guard = NoHostSync()
    with guard:
        loss, stats = topk_kl_loss(
            logits,
            *teacher_and_options(ids, logprobs, mask=mask, validate=False, chunk_size=5, **options),
        )
        loss.sum().backward()
    assert guard.ops > 0
    want, want_stats = topk_kl_loss(
        logits.detach(), *teacher_and_options(ids, logprobs, mask=mask, **options)
    )
    torch.testing.assert_close(loss.detach(), want)
    assert stats == want_stats  # computed lazily, now that the guard is gone
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


# A bf16 weight takes another path for its gradient (the teacher columns summed in fp32,
# `split_columns`): checked too.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_does_not_sync(options, grad_in_forward, dtype, device) -> None:
    hidden, weight, ids, logprobs, mask = _problem(1, dtype, device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    guard = NoHostSync()
    with guard:
        loss, stats = lm_head_topk_kl_loss(
            weight,
            hidden,
            *teacher_and_options(
                ids,
                logprobs,
                mask=mask,
                validate=False,
                chunk_size=7,
                grad_in_forward=grad_in_forward,
                **options,
            ),
        )
        loss.sum().backward()
    assert guard.ops > 0
    want, want_stats = lm_head_topk_kl_loss(
        weight.detach(),
        hidden.detach(),
        *teacher_and_options(ids, logprobs, mask=mask, chunk_size=7, **options),
    )
    torch.testing.assert_close(loss.detach(), want)
    assert stats == want_stats
    assert math.isfinite(stats.loss) and stats.positions == int(mask.sum())
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_validation_does_sync_and_the_guard_sees_it(device: str) -> None:
    """The default (`validate=True`) checks values, which the guard must catch."""
    hidden, weight, ids, logprobs, mask = _problem(2, device=device)
    with pytest.raises(SYNC_ERRORS, match=SYNC_MESSAGE), NoHostSync():
        lm_head_topk_kl_loss(weight, hidden, TeacherTargets(ids, logprobs, mask=mask))


@pytest.mark.parametrize("device", DEVICES)
def test_stats_tensors_need_no_sync(device: str) -> None:
    hidden, weight, ids, logprobs, mask = _problem(3, device=device)
    with NoHostSync():
        _, stats = lm_head_topk_kl_loss(
            weight, hidden, TeacherTargets(ids, logprobs, mask=mask), LossOptions(validate=False)
        )
        tensors = stats.tensors()
    assert set(tensors) == {*stats.as_dict()}
    assert float(tensors["loss"]) == stats.loss
    assert int(tensors["positions"]) == stats.positions


def _candidates(ids: torch.Tensor, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Candidates `[..., 5]` for `ids` `[..., K]`: random ids, a repeat of a top-k id, a
    repeat of each other and -1 padding; the teacher's log-probs there (NaN at -1)."""
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.randint(0, vocab, (*ids.shape[:-1], 5), generator=generator)
    candidates[..., 1] = ids[..., 0]
    candidates[..., 2] = candidates[..., 0]
    candidates[..., 4] = -1
    logprobs = torch.log(torch.rand(candidates.shape, generator=generator) * 0.05)
    return {
        "candidate_ids": candidates,
        "candidate_logprobs": torch.where(candidates >= 0, logprobs, math.nan),
    }


@pytest.mark.parametrize(
    ("fused", "dtype"),
    [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
    ids=["logits", "fused", "fused-bf16"],
)
@pytest.mark.parametrize(
    "options",
    [
        {"support": "student", "divergence": "reverse"},
        {"support": "union", "divergence": "jsd", "mode": "tail_actual", "overlap": True},
        {"support": "union", "mode": "truncated", "reduction": "none"},
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_candidate_supports_do_not_sync(options, fused, dtype, device) -> None:
    hidden, weight, ids, logprobs, mask = _problem(4, dtype, device)
    extra = {
        name: value.to(device) for name, value in _candidates(ids.cpu(), weight.shape[0], 4).items()
    }
    if options.get("mode") == "tail_actual":
        extra["sampled_ids"] = extra["candidate_ids"][..., 0]
        extra["sampled_logprobs"] = torch.full(mask.shape, -3.0, device=device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    call = teacher_and_options(
        ids, logprobs, mask=mask, validate=False, chunk_size=5, **options, **extra
    )
    guard = NoHostSync()
    with guard:
        if fused:
            loss, stats = lm_head_topk_kl_loss(weight, hidden, *call)
        else:
            loss, stats = topk_kl_loss(hidden @ weight.T, *call)
        loss.sum().backward()
    assert guard.ops > 0
    want, want_stats = topk_kl_loss(
        (hidden @ weight.T).detach(),
        *teacher_and_options(ids, logprobs, mask=mask, chunk_size=5, **options, **extra),
    )
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert stats.positions == want_stats.positions
    assert hidden.grad is not None and bool(hidden.grad.abs().sum() > 0)
