"""`examples.distill.distill_loss`: the fused path (default) trains like the logits path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from examples import distill


@pytest.mark.parametrize("mode", ["tail", "truncated"])
def test_fused_and_logits_paths_give_the_same_loss_and_gradients(mode: str) -> None:
    vocab, top_k = 64, 5
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (2, 9), generator=generator)
    teacher = torch.log_softmax(torch.randn(2, 9, vocab, generator=generator) * 2, -1)
    logprobs, ids = teacher.topk(top_k, dim=-1)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    payload = SimpleNamespace(ids=ids.int(), logprobs=logprobs.half(), mask=mask)

    results = {}
    for fused in (True, False):
        cfg = distill.DistillConfig(hidden_size=32, loss_mode=mode, fused=fused)  # type: ignore[arg-type]
        student = distill.student_model(vocab, cfg)  # same seed: same weights
        loss, stats = distill.distill_loss(student, x, payload, cfg)
        loss.backward()
        grads = {name: p.grad for name, p in student.named_parameters()}
        results[fused] = (loss.detach(), stats, grads)

    (fused_loss, fused_stats, fused_grads), (loss, stats, grads) = results[True], results[False]
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    assert fused_stats.positions == stats.positions == 15
    assert fused_stats.overlap == pytest.approx(stats.overlap)
    for name, grad in grads.items():
        assert grad is not None and fused_grads[name] is not None, name
        scale = float(grad.abs().max())
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5 * scale)


def test_parser_has_loss_mode_and_fused_flags() -> None:
    args = distill.build_parser().parse_args(["--replay", "x", "--loss-mode", "truncated"])
    assert args.loss_mode == "truncated" and args.fused is True
    args = distill.build_parser().parse_args(["--replay", "x", "--no-fused"])
    assert args.fused is False and args.loss_mode == "tail"
