"""The on-policy held-out metric: KL(student || teacher) over the student's own
continuations of held-out prompts.

This is what on-policy distillation optimises (Thinking Machines' on-policy distillation
and verl report it): the student continues held-out prompts by sampling (temperature 1,
no top-k / top-p: the sampling of ``examples/onpolicy.py``'s training), and at every
response position the full-vocabulary KL(student || teacher) of the next-token
distributions is averaged. The teacher-forced metrics of :func:`examples.distill.evaluate`
score natural text; this one scores the prefixes the student itself writes. The sampling
uses its own fixed seed (the training's random state is left untouched), so the same
student gives the same number.
"""

from __future__ import annotations

from typing import Any

import torch

from examples.data import PAD_ID
from examples.distill import EvalResult, evaluate

__all__ = ["EVAL_SEED", "evaluate_with_onpolicy", "kl_student_teacher", "onpolicy_kl"]

#: The seed of the student's sampling in :func:`onpolicy_kl` (the same for every run).
EVAL_SEED = 1234


def kl_student_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary ``KL(student || teacher)`` at every position.

    ``student_logits`` and ``teacher_logits``: ``[..., V]`` (e.g. ``[B, R, V]``), the
    next-token logits of the two models at the same positions, same vocabulary. Returns
    ``[...]`` float32: ``sum_v q(v) (log q(v) - log p(v))`` with ``q = softmax(student)``,
    ``p = softmax(teacher)``, in nats (0 where the two distributions are equal).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"logits: shapes differ, student {tuple(student_logits.shape)}, teacher "
            f"{tuple(teacher_logits.shape)}"
        )
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


@torch.no_grad()
def onpolicy_kl(
    student: Any,
    teacher: Any,
    prompts: torch.Tensor,
    response: int,
    *,
    seed: int = EVAL_SEED,
    batch: int = 16,
) -> float:
    """Mean ``KL(student || teacher)`` per response token, nats, over the student's own
    continuations of ``prompts`` ``[N, P]`` (unpadded byte prompts of one length).

    The student samples ``response`` tokens after each prompt (temperature 1, seeded with
    ``seed``, in chunks of ``batch``); both models then read the ``[N, P + response]``
    sequences and :func:`kl_student_teacher` compares their distributions at the rows
    ``P - 1 .. P + response - 2``, the ones that predicted the sampled tokens.
    """
    was_training = student.training
    student.eval()
    p = prompts.shape[1]
    total, count = 0.0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch):
            x = prompts[i : i + batch]
            seqs = student.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=response,
                min_new_tokens=response,
                pad_token_id=PAD_ID,
            )  # [b, P + R]
            rows = slice(p - 1, p + response - 1)
            ls = student(input_ids=seqs).logits[:, rows]  # [b, R, V]
            lt = teacher(input_ids=seqs).logits[:, rows]
            kl = kl_student_teacher(ls, lt)  # [b, R]
            total += float(kl.double().sum())
            count += kl.numel()
    student.train(was_training)
    return total / count


def evaluate_with_onpolicy(
    student: Any, teacher: Any, windows: torch.Tensor, prompts: torch.Tensor, response: int
) -> EvalResult:
    """:func:`examples.distill.evaluate` on ``windows`` (teacher-forced) plus
    :func:`onpolicy_kl` on ``prompts`` (``EvalResult.onpolicy_kl``)."""
    result = evaluate(student, teacher, windows)
    result.onpolicy_kl = onpolicy_kl(student, teacher, prompts, response)
    return result
