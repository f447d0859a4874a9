"""`examples.distill` / `examples.onpolicy` wiring of the divergences: every
`--divergence` x `--mode` reaches the loss (fused = logits path, as `test_distill_loss.py`
checks for the forward KL), `--beta` builds the JSD, and the on-policy example defaults to
the reverse KL."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from examples import distill, onpolicy
from student_client.losses import get_divergence


@pytest.mark.parametrize("mode", ["tail", "tail_actual"])
@pytest.mark.parametrize(("divergence", "beta"), [("reverse", None), ("jsd", 0.3)])
def test_every_divergence_trains_through_both_paths(divergence, beta, mode) -> None:
    vocab, top_k = 64, 5
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2, 9), generator=generator)
    teacher = torch.log_softmax(torch.randn(2, 9, vocab, generator=generator) * 2, -1)
    logprobs, ids = teacher.topk(top_k, dim=-1)
    sampled = teacher.gather(-1, torch.roll(x, -1, dims=-1).unsqueeze(-1)).squeeze(-1)
    sampled[:, -1] = math.nan
    payload = SimpleNamespace(
        ids=ids,
        logprobs=logprobs,
        mask=torch.ones(2, 9, dtype=torch.bool),
        sampled_logprobs=sampled,
    )
    losses = []
    for fused in (True, False):
        cfg = distill.DistillConfig(
            hidden_size=32, loss_mode=mode, fused=fused, divergence=divergence, beta=beta
        )
        options = distill.loss_options(cfg)
        assert options.divergence == get_divergence(
            divergence, **({} if beta is None else {"beta": beta})
        )
        student = distill.student_model(vocab, cfg)
        loss, stats = distill.distill_loss(student, x, payload, cfg)
        loss.backward()
        assert stats.positions == 18 and math.isfinite(stats.loss)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_flags() -> None:
    args = distill.build_parser().parse_args(
        ["--replay", "x", "--divergence", "jsd", "--beta", "0.25", "--mode", "tail_actual"]
    )
    assert (args.divergence, args.beta, args.loss_mode) == ("jsd", 0.25, "tail_actual")
    assert distill.build_parser().parse_args(["--replay", "x"]).divergence == "forward"
    assert onpolicy.build_parser().parse_args([]).divergence == "reverse"
    assert onpolicy.OnPolicyConfig().divergence == "reverse"
