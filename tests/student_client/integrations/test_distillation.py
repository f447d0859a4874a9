"""``distillation_loss`` with the student's candidates: supports "student" / "union" read
``candidate_ids`` / ``candidate_logprobs`` from the batch's payload (one value under
``TEACHER_KEY``) and give ``topk_kl_loss``'s loss on the model's logits, logits path and
fused path alike; a payload without them is a named error; support "teacher" ignores
them."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from devtools.tiny_model import tiny_qwen2_config
from student_client.integrations.distillation import (
    TEACHER_KEY,
    distillation_loss,
    per_teacher_metrics,
)
from student_client.integrations.distillation_config import DistillationConfig
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
from topk_protocol.requests import RequestOptions

B, T, K, C = 2, 9, 4, 5


@pytest.fixture(scope="module")
def student() -> Any:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config(hidden_size=32, num_layers=1, head_dim=16, initializer_range=0.02)
    return Qwen2ForCausalLM(config)


def _batch(vocab: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (B, T), generator=generator)
    teacher = torch.log_softmax(torch.randn(B, T, vocab, generator=generator) * 2, -1)
    logprobs, ids = teacher.topk(K, dim=-1)
    candidates = torch.randint(0, vocab, (B, T, C), generator=generator)
    candidates[..., 0] = ids[..., 0]  # one repeat of a top-k id per position
    candidates[0, 2:4, 3:] = -1  # padded entries
    payload = SimpleNamespace(
        ids=ids,
        logprobs=logprobs,
        mask=torch.ones(B, T, dtype=torch.bool),
        sampled_logprobs=None,
        candidate_ids=candidates,
        candidate_logprobs=torch.where(
            candidates >= 0, teacher.gather(-1, candidates.clamp_min(0)), math.nan
        ),
    )
    return {"input_ids": input_ids, TEACHER_KEY: payload}


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("support", ["student", "union"])
def test_candidates_reach_the_loss(student, support, fused) -> None:
    batch = _batch(student.config.vocab_size)
    config = DistillationConfig(
        RequestOptions(K),
        loss=LossOptions(support=support, divergence="reverse"),
        candidates=C,
        fused=fused,
    )
    loss, metrics, _ = distillation_loss(student, batch, config)
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"]).logits
    teacher = TeacherTargets.from_payload(batch[TEACHER_KEY])
    want, _ = topk_kl_loss(logits, teacher, config.loss)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    teacher_only, _, _ = distillation_loss(
        student,
        batch,
        DistillationConfig(RequestOptions(K), loss=LossOptions(divergence="reverse")),
    )
    assert not torch.allclose(teacher_only, loss)  # the support changed the loss
    assert float(metrics["kd_positions"]) == B * T
    per_teacher = per_teacher_metrics(
        SimpleNamespace(logits=logits),
        batch,
        dataclasses.replace(config, fused=False),
        ["a", "b"],
    )
    assert set(per_teacher) >= {"kd_loss/a", "kd_loss/b"}


def test_a_batch_without_candidates_is_a_named_error(student) -> None:
    batch = _batch(student.config.vocab_size)
    batch[TEACHER_KEY].candidate_ids = batch[TEACHER_KEY].candidate_logprobs = None
    config = DistillationConfig(RequestOptions(K), loss=LossOptions(support="union"), candidates=C)
    with pytest.raises(
        ValueError, match=r"^inputs: support 'union' needs the payload's candidate_ids"
    ):
        distillation_loss(student, batch, config)
    # Support "teacher" does not use candidates in the batch (nor pass them to the model).
    loss, _, _ = distillation_loss(
        student, _batch(student.config.vocab_size), DistillationConfig(RequestOptions(K))
    )
    assert math.isfinite(float(loss.detach()))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DistillationConfig(request=16), r"^request: must be a RequestOptions"),  # type: ignore[arg-type]
        (
            lambda: DistillationConfig(
                RequestOptions(8, samples=8, seed=0), loss=LossOptions(divergence="reverse")
            ),
            r"^divergence: the sampled loss supports 'forward' only",
        ),
        (
            lambda: DistillationConfig(
                RequestOptions(8, samples=8, seed=0),
                loss=LossOptions(support="union"),
                candidates=2,
            ),
            r"^support: 'union' does not apply to the sampled loss",
        ),
        (
            lambda: DistillationConfig(
                RequestOptions(8, include_sampled=False), loss=LossOptions(mode="tail_actual")
            ),
            r"^loss: mode 'tail_actual' needs .*include_sampled",
        ),
        (
            lambda: DistillationConfig(loss=LossOptions(support="union")),
            r"^candidates: support 'union' needs the student's candidates",
        ),
        (lambda: DistillationConfig(candidates=4), r"^candidates: 4 asked with support 'teacher'"),
        (lambda: DistillationConfig(candidates=-1), r"^candidates: must be >= 0"),
        (lambda: DistillationConfig(loss=LossOptions(reduction="sum")), r"^loss: reduction"),
        (lambda: DistillationConfig(alpha=0.5, fused=True), r"^fused: needs alpha = 0"),
    ],
)
def test_the_config_checks_every_option_at_construction(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_the_default_config_asks_what_the_default_loss_uses() -> None:
    config = DistillationConfig()
    assert config.request == RequestOptions(16)
    assert config.request.include_sampled  # the one default (RequestOptions')
    assert config.loss == LossOptions()
