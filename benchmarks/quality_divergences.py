"""Which divergence distils best? The demo teacher, the demo student, every divergence x
mode at K = 4 and 16, same steps, data and seed; held-out full-vocabulary metrics.

Run from the repository root (builds the demo teacher first if it is not cached)::

    python -m benchmarks.quality_divergences [--steps 150] [--top-k 4 16] [--out runs/quality]

Each run trains a fresh student (`examples.distill.student_model`, seed 0) on the same
byte windows of the standard library's sources, with the fused lm_head loss
(`lm_head_topk_kl_loss`) against the teacher's top-k of each window, and then measures, on
held-out files, the full-vocabulary KL(teacher || student), KL(student || teacher) and the
student's cross-entropy (`examples.distill.evaluate`). The teacher's payload is computed in
this process from the teacher's transformers forward (`log_softmax`, `topk`, and the
log-prob of the actual next byte, NaN at a window's last position): the numbers the
transformers backend would serve, without a server (twelve runs, one teacher). The
on-policy comparison (forward vs reverse) is `examples/onpolicy.py --divergence ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from examples.data import WindowSampler, fixed_windows, load_stdlib_corpus
from examples.distill import DistillConfig, EvalResult, evaluate, student_model
from examples.teacher_pretrain import DEFAULT_CACHE_DIR, build_default_teacher
from student_client.losses import (
    LossOptions,
    TeacherTargets,
    causal_lm_hidden_and_head,
    get_divergence,
    lm_head_topk_kl_loss,
)
from student_client.losses.types import LossMode

__all__ = [
    "QualityRow",
    "main",
    "teacher_log_probs",
    "teacher_payload",
    "topk_payload",
    "train_one",
    "train_student",
]

#: (label, registry name, parameters) of the divergences compared.
DIVERGENCES: list[tuple[str, str, dict[str, Any]]] = [
    ("forward KL", "forward", {}),
    ("reverse KL", "reverse", {}),
    ("JSD(0.5)", "jsd", {"beta": 0.5}),
]
MODES: tuple[LossMode, ...] = ("tail", "tail_actual")


@dataclass
class QualityRow:
    top_k: int
    divergence: str
    mode: str
    after: EvalResult
    seconds: float


@torch.inference_mode()
def teacher_log_probs(teacher: Any, x: torch.Tensor) -> torch.Tensor:
    """The teacher's full next-token log-softmax `[B, T, V]` (float32) for windows `x`
    `[B, T]`."""
    return torch.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)


@torch.inference_mode()
def topk_payload(log_p: torch.Tensor, x: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """The top-k `[B, T, K]` of full log-probs `log_p` `[B, T, V]` of windows `x` `[B, T]`,
    the next token `[B, T]` and its log-prob `[B, T]` (NaN at the last position)."""
    logprobs, ids = log_p.topk(top_k, dim=-1)
    following = torch.roll(x, -1, dims=-1)
    sampled = log_p.gather(-1, following.unsqueeze(-1)).squeeze(-1)
    sampled[:, -1] = math.nan
    return {"ids": ids, "logprobs": logprobs, "sampled_ids": following, "sampled": sampled}


def teacher_payload(teacher: Any, x: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """:func:`topk_payload` of the teacher's forward on `x` `[B, T]`."""
    return topk_payload(teacher_log_probs(teacher, x), x, top_k)


#: One training step's loss: (student, window `[B, T]`) -> scalar.
StepLoss = Callable[[Any, torch.Tensor], torch.Tensor]


def train_student(
    teacher: Any,
    batches: list[torch.Tensor],
    heldout: torch.Tensor,
    cfg: DistillConfig,
    step_loss: StepLoss,
) -> tuple[EvalResult, float]:
    """Train a fresh student (`student_model`, seeded by `cfg.seed`) on `batches`, one
    AdamW step of `step_loss` each (one-cycle learning rate, gradient norm clipped to 1);
    its held-out metrics against `teacher` and the training seconds."""
    student = student_model(int(teacher.config.vocab_size), cfg)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=len(batches), pct_start=0.1
    )
    start = time.perf_counter()
    for x in batches:
        loss = step_loss(student, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
    seconds = time.perf_counter() - start
    return evaluate(student, teacher, heldout), seconds


def train_one(
    source: Any,
    batches: list[torch.Tensor],
    heldout: torch.Tensor,
    cfg: DistillConfig,
    options: LossOptions,
) -> tuple[EvalResult, float]:
    """Train a fresh student on `batches` with `options`; held-out metrics and seconds."""

    def step_loss(student: Any, x: torch.Tensor) -> torch.Tensor:
        payload = teacher_payload(source, x, cfg.top_k)
        actual: dict[str, Any] = {}
        if options.mode == "tail_actual":
            actual = {"sampled_ids": payload["sampled_ids"], "sampled_logprobs": payload["sampled"]}
        head = causal_lm_hidden_and_head(student, input_ids=x)
        teacher = TeacherTargets(payload["ids"], payload["logprobs"], **actual)
        loss, _ = lm_head_topk_kl_loss((head.weight, head.bias), head.hidden, teacher, options)
        return loss

    return train_student(source, batches, heldout, cfg, step_loss)


def format_table(rows: list[QualityRow], before: EvalResult, steps: int, cfg: DistillConfig) -> str:
    lines = [
        f"{steps} steps x {cfg.batch_size} x {cfg.seq_len} bytes, seed {cfg.seed}; held-out "
        f"{cfg.eval_windows} windows x {cfg.seq_len} bytes, nats per byte (lower is better). "
        f"Untrained student: KL(t||s) {before.kl_teacher_student:.3f}, KL(s||t) "
        f"{before.kl_student_teacher:.3f}, CE {before.student_ce:.3f}; teacher CE "
        f"{before.teacher_ce:.3f}.",
        "",
        "| K | divergence | mode | KL(teacher \\|\\| student) | KL(student \\|\\| teacher) "
        "| student CE | train s |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        a = row.after
        lines.append(
            f"| {row.top_k} | {row.divergence} | {row.mode} | {a.kl_teacher_student:.4f} "
            f"| {a.kl_student_teacher:.4f} | {a.student_ce:.4f} | {row.seconds:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality_divergences")
    ap.add_argument("--teacher-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--top-k", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/quality"))
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    teacher_dir = build_default_teacher(args.teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    corpus = load_stdlib_corpus()
    heldout = fixed_windows(corpus.heldout, length=args.seq_len, count=args.eval_windows)
    sampler = WindowSampler(
        corpus.train, batch_size=args.batch_size, length=args.seq_len, seed=args.seed
    )
    batches = [sampler.sample() for _ in range(args.steps)]  # the same for every run
    rows: list[QualityRow] = []
    before = None
    for top_k in args.top_k:
        cfg = DistillConfig(
            batch_size=args.batch_size, seq_len=args.seq_len, top_k=top_k, seed=args.seed,
            eval_windows=args.eval_windows,
        )  # fmt: skip
        if before is None:
            before = evaluate(student_model(int(teacher.config.vocab_size), cfg), teacher, heldout)
        for label, name, params in DIVERGENCES:
            for mode in MODES:
                options = LossOptions(divergence=get_divergence(name, **params), mode=mode)
                after, seconds = train_one(teacher, batches, heldout, cfg, options)
                rows.append(QualityRow(top_k, label, mode, after, seconds))
                print(f"K={top_k} {label} {mode}: {after}", flush=True)
    assert before is not None
    table = format_table(rows, before, args.steps, cfg)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(
        json.dumps({"before": asdict(before), "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    (args.out / "quality.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
