"""The README's training loop (``examples/training_loop.py``) against the live vLLM
teacher: a few steps of a tiny student, finite and decreasing loss, gradients flow."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ServerProcess

pytest.importorskip("student_client.losses")

from examples import training_loop

pytestmark = pytest.mark.vllm


def test_training_loop_snippet_learns(
    vllm_teacher: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    losses = training_loop.main(["--teacher", vllm_teacher.target, "--steps", "12"])
    assert len(losses) == 12
    assert all(math.isfinite(x) and x >= 0 for x in losses)
    # The same 4 batches cycle: compare each batch's loss on its last visit vs its first.
    first, last = losses[:4], losses[-4:]
    assert all(b < a for a, b in zip(first, last, strict=True)), losses
    assert "teacher mass" in capsys.readouterr().out


def test_training_loop_backprop_reaches_the_student(vllm_teacher: ServerProcess) -> None:
    from student_client.client import TeacherClient
    from student_client.losses import topk_kl_loss

    student = training_loop.ToyStudent(512)
    x = next(training_loop.token_batches(1, 2, 16, 512))
    with TeacherClient(vllm_teacher.target, expect_vocab_size=512) as client:
        payload = next(client.stream([x], 8, depth=1))
    loss, _ = topk_kl_loss(
        student(x), payload.ids, payload.logprobs, mode="tail", mask=payload.mask
    )
    loss.backward()
    grads = [p.grad for p in student.parameters()]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)
