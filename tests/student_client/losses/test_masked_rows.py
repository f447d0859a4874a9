"""Rows the teacher has no distribution for (a teacher row of all NaN: a student
tokenizer's masked row, docs/cross_tokenizer.md) do not count, in every loss entry point
and in the Trainer's loss: a payload with such rows gives the same loss and the same
gradients as the same payload with those rows removed (or, where the rows cannot be
removed from a causal LM's sequence, masked out), and the statistics count them out.
Odd shapes (3 x 47 positions, V = 123, K = 5), float64."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from devtools.tiny_model import tiny_qwen2_config
from student_client.losses import (
    LossOptions,
    TeacherTargets,
    TopKKLLoss,
    causal_lm_topk_kl_loss,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.onpolicy import kl_estimators

B, T, V, K, H = 3, 47, 123, 5, 16
MODES = ["tail", "tail_actual", "truncated"]
REDUCTIONS = ["mean", "sum"]


def _payload(seed: int = 0) -> dict[str, torch.Tensor]:
    """A teacher payload ``[B, T, K]`` with about a fifth of its rows masked (all NaN,
    their actual-token log-prob NaN too) and a padding mask on the last rows of row 1."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.log_softmax(torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2, -1)
    logprobs, ids = full.topk(K, dim=-1)
    sampled_ids = torch.randint(0, V, (B, T), generator=gen)
    sampled = full.gather(-1, sampled_ids[..., None])[..., 0]
    masked = torch.rand(B, T, generator=gen) < 0.2
    masked[0, 0] = masked[2, -1] = True  # a sequence's first and last rows
    logprobs = torch.where(masked[..., None], torch.nan, logprobs)
    sampled = torch.where(masked, torch.nan, sampled)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -6:] = False
    return {
        "ids": ids,
        "logprobs": logprobs,
        "sampled_ids": sampled_ids,
        "sampled_logprobs": sampled,
        "mask": mask,
        "masked": masked,
    }


def _teacher(p: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> TeacherTargets:
    """The payload's teacher value; with ``keep`` (bool ``[B, T]``) only those rows, as
    ``[n, ...]`` (the same payload with the other rows removed)."""
    if keep is None:
        return TeacherTargets(
            p["ids"],
            p["logprobs"],
            mask=p["mask"],
            sampled_ids=p["sampled_ids"],
            sampled_logprobs=p["sampled_logprobs"],
        )
    return TeacherTargets(
        p["ids"][keep],
        p["logprobs"][keep],
        sampled_ids=p["sampled_ids"][keep],
        sampled_logprobs=p["sampled_logprobs"][keep],
    )


def _kept(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return p["mask"] & ~p["masked"]


def _close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ["topk_kl_loss", "TopKKLLoss"])
def test_logits_path(entry: str, mode: str, reduction: str) -> None:
    p = _payload()
    keep = _kept(p)
    opts = LossOptions(mode=mode, reduction=reduction, chunk_size=7)
    loss_fn = topk_kl_loss if entry == "topk_kl_loss" else TopKKLLoss(opts)
    logits = torch.randn(B, T, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    whole = logits.clone().requires_grad_(True)
    part = logits[keep].clone().requires_grad_(True)
    args = () if entry == "TopKKLLoss" else (opts,)
    got, stats = loss_fn(whole, _teacher(p), *args)  # type: ignore[operator]
    want, want_stats = loss_fn(part, _teacher(p, keep), *args)  # type: ignore[operator]
    _close(got, want)
    got.backward()
    want.backward()
    assert whole.grad is not None and part.grad is not None
    _close(whole.grad[keep], part.grad)
    assert not whole.grad[~keep].any()  # masked and padding rows: no gradient
    assert stats.positions == want_stats.positions == int(keep.sum())
    _close(stats.tensors()["teacher_mass"], want_stats.tensors()["teacher_mass"])


@pytest.mark.parametrize("mode", MODES)
def test_lm_head_path(mode: str) -> None:
    p = _payload(1)
    keep = _kept(p)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, T, H, dtype=torch.float64, generator=gen)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen)
    opts = LossOptions(mode=mode, chunk_size=5)
    w1, w2 = weight.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h1, h2 = hidden.clone().requires_grad_(True), hidden[keep].clone().requires_grad_(True)
    got, _ = lm_head_topk_kl_loss(w1, h1, _teacher(p), opts)
    want, _ = lm_head_topk_kl_loss(w2, h2, _teacher(p, keep), opts)
    _close(got, want)
    got.backward()
    want.backward()
    assert h1.grad is not None and w1.grad is not None
    _close(h1.grad[keep], h2.grad)
    _close(w1.grad, w2.grad)
    assert not h1.grad[~keep].any()


def _model() -> Any:
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(vocab_size=V, hidden_size=32, num_layers=1, head_dim=16)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).double()


def test_causal_lm_path() -> None:
    """A causal LM's rows cannot leave its sequence: NaN rows against the same rows
    masked out, every parameter's gradient."""
    p = _payload(2)
    model = _model()
    reference = copy.deepcopy(model)
    input_ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    inputs = {"input_ids": input_ids}
    got, _ = causal_lm_topk_kl_loss(model, inputs, _teacher(p), LossOptions(chunk_size=9))
    clean = {**p, "logprobs": torch.nan_to_num(p["logprobs"], nan=-1.0), "mask": _kept(p)}
    want, _ = causal_lm_topk_kl_loss(reference, inputs, _teacher(clean), LossOptions(chunk_size=9))
    _close(got, want)
    got.backward()
    want.backward()
    for (name, a), (_, b) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None, name
        _close(a.grad, b.grad)


@pytest.mark.parametrize("fused", [False, True])
def test_the_trainers_loss(fused: bool) -> None:
    """``distillation_loss`` (what ``TopKDistillationTrainer.compute_loss`` runs) on a
    batch whose payload has masked rows, against the same rows masked out."""
    from student_client.data.payload import TeacherPayload
    from student_client.integrations.distillation import TEACHER_KEY, distillation_loss
    from student_client.integrations.distillation_config import DistillationConfig

    p = _payload(3)
    model = _model()
    reference = copy.deepcopy(model)
    input_ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(6))

    def batch(logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        payload = TeacherPayload(
            ids=p["ids"],
            logprobs=logprobs.float(),
            sampled_logprobs=p["sampled_logprobs"].float(),
            mask=mask,
            position_start=torch.zeros(B, dtype=torch.int64),
            lengths=mask.sum(-1),
            top_k=K,
            dtype="float32",
        )
        return {"input_ids": input_ids, TEACHER_KEY: payload}

    config = DistillationConfig(loss=LossOptions(chunk_size=8), fused=fused)
    got, metrics, _ = distillation_loss(model, batch(p["logprobs"], p["mask"]), config)
    clean = torch.nan_to_num(p["logprobs"], nan=-1.0)
    want, want_metrics, _ = distillation_loss(reference, batch(clean, _kept(p)), config)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    got.backward()
    want.backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8)
    assert metrics.keys() == want_metrics.keys()


def test_on_policy_estimators_skip_rows_without_a_teacher_value() -> None:
    """The on-policy signal reads the actual token's log-prob, NaN on masked rows."""
    p = _payload(4)
    keep = _kept(p)
    student = torch.log_softmax(torch.randn(B, T, V, dtype=torch.float64), -1)
    student_lp = student.gather(-1, p["sampled_ids"][..., None])[..., 0]
    got = kl_estimators(student_lp, p["sampled_logprobs"], p["mask"])
    want = kl_estimators(student_lp[keep], p["sampled_logprobs"][keep])
    for name in ("k1", "k3"):
        _close(getattr(got, name)[keep], getattr(want, name))
        assert not getattr(got, name)[~keep].any()


@pytest.mark.parametrize("mode", MODES)
def test_the_dense_reference(mode: str) -> None:
    """``topk_kl_reference`` reduces and masks nothing: its terms at the other rows are
    those of the payload with the masked rows removed, and so is the gradient of their
    sum; a masked row's terms are 0, with no gradient."""
    from student_client.losses import topk_kl_reference

    p = _payload(5)
    keep = ~p["masked"]
    logits = torch.randn(B, T, V, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    whole = logits.clone().requires_grad_(True)
    part = logits[keep].clone().requires_grad_(True)
    opts = LossOptions(mode=mode)
    got = topk_kl_reference(whole, _teacher(p), opts)
    want = topk_kl_reference(part, _teacher(p, keep), opts)
    for name in ("loss", "head", "tail", "teacher_mass", "student_mass"):
        _close(getattr(got, name)[keep], getattr(want, name))
        assert not getattr(got, name)[~keep].any(), name
    got.loss.sum().backward()
    want.loss.sum().backward()
    assert whole.grad is not None and part.grad is not None
    _close(whole.grad[keep], part.grad)
    assert not whole.grad[~keep].any()
