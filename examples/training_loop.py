"""The distillation training loop in its smallest form (the README's snippet, runnable).

Teacher payloads stream in with prefetch (``depth`` requests in flight while the student
computes); the student's logits meet them in the tail-aware top-k KL; backward; step.

    python -m examples.training_loop --teacher 127.0.0.1:50051 [--steps 20]

The student here is a toy (embedding + linear over the teacher's vocabulary) and the
data random windows of token ids, repeated every few steps; put your model and data
loader in their place.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from student_client.clients.blocking import TeacherClient
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss

__all__ = ["ToyStudent", "main", "token_batches", "train"]


class ToyStudent(nn.Module):
    """``[B, T]`` token ids -> ``[B, T, V]`` next-token logits (a bigram model)."""

    def __init__(self, vocab_size: int, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def token_batches(
    steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """``steps`` batches ``[B, T]`` cycling over 4 fixed random ones (a stand-in loader)."""
    g = torch.Generator().manual_seed(seed)
    fixed = [torch.randint(0, vocab_size, (batch_size, seq_len), generator=g) for _ in range(4)]
    for step in range(steps):
        yield fixed[step % len(fixed)]


def train(
    client: TeacherClient,
    *,
    steps: int = 20,
    batch_size: int = 4,
    seq_len: int = 64,
    top_k: int = 16,
    depth: int = 4,
    lr: float = 1e-2,
) -> list[float]:
    """Distil a :class:`ToyStudent` for ``steps`` steps; return the loss of every step."""
    vocab_size = client.info().vocab_size
    student = ToyStudent(vocab_size)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    losses = []
    # --- the loop (docs/training_loop.md) ---------------------------------------------
    loader = token_batches(steps, batch_size, seq_len, vocab_size)
    options = LossOptions(mode="tail")
    to_student, to_teacher = itertools.tee(loader)  # the teacher reads `depth` batches ahead
    payloads = client.stream(to_teacher, top_k, depth=depth)
    for x, payload in zip(to_student, payloads, strict=True):
        logits = student(x)  # [B, T, V]; payload.ids / .logprobs: [B, T, K]
        teacher = TeacherTargets.from_payload(payload)  # the one teacher value, with its mask
        loss, stats = topk_kl_loss(logits, teacher, options)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"loss {loss.item():.4f}  teacher mass {stats.teacher_mass:.3f}")
    # -----------------------------------------------------------------------------------
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="teacher target, host:port")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args(argv)
    with TeacherClient(args.teacher) as client:
        return train(client, steps=args.steps, top_k=args.top_k, depth=args.depth)


if __name__ == "__main__":
    main()
