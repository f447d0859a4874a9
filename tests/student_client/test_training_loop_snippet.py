"""The README's training loop (``examples/training_loop.py``) against the live vLLM
teacher: a few steps of a tiny student, finite and decreasing loss, gradients flow."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ROOT, ServerProcess

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
    from student_client.clients.blocking import TeacherClient
    from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss

    student = training_loop.ToyStudent(512)
    x = next(training_loop.token_batches(1, 2, 16, 512))
    with TeacherClient(vllm_teacher.target, expect_vocab_size=512) as client:
        payload = next(client.stream([x], 8, depth=1))
    loss, _ = topk_kl_loss(
        student(x),
        TeacherTargets(payload.ids, payload.logprobs, mask=payload.mask),
        LossOptions(mode="tail"),
    )
    loss.backward()
    grads = [p.grad for p in student.parameters()]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def _loop_lines(text: str) -> list[str]:
    """The loop of a snippet: stripped lines from the ``tee`` to ``opt.step()``."""
    lines = [ln.strip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("to_student, to_teacher ="))
    end = lines.index("opt.step()", start)
    return [ln for ln in lines[start : end + 1] if ln]


def test_readme_snippet_is_the_loop_that_runs() -> None:
    """The README's snippet is, line for line, the loop the test above runs."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The training loop", 1)[1].split("```python", 1)[1].split("```")[0]
    example = (ROOT / "examples" / "training_loop.py").read_text()
    assert _loop_lines(section) == _loop_lines(example)
