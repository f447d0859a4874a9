"""``TopKDistillationTrainer`` data parallel: one process or ``accelerate launch``.

    python -m examples.trainer_distill --teacher 127.0.0.1:50051
    accelerate launch --multi_gpu --num_processes 2 -m examples.trainer_distill \\
        --teacher 127.0.0.1:50051 [--record runs/trainer]

(On a machine without GPUs ``--multi_gpu`` still starts the processes through
``torchrun``; accelerate then trains on the CPU with gloo. ``--cpu`` with more than one
process wants ``mpirun``.) Every rank opens its own teacher client, prefetches the
payloads of its own batches (accelerate shards them: with ``--batch-size B`` on ``W``
processes, optimizer step ``s`` trains rows ``[s * B * W, (s + 1) * B * W)``), records
to ``<record>/rank-0000r``, and the Trainer logs ``kd_*`` averaged over the ranks. The
student is a fresh small Qwen2 on random token windows; docs/scaling.md explains the setup.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "student", "train", "window_examples"]


def student(vocab_size: int, seed: int = 0) -> Any:
    """A fresh tiny ``Qwen2ForCausalLM`` (same weights for the same seed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(Qwen2Config(**fields))


def window_examples(n: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` random token windows as Trainer examples (``{"input_ids": [...]}``)."""
    g = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, vocab_size, (n, seq_len), generator=g)
    return [{"input_ids": row.tolist()} for row in windows]


def _collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([e["input_ids"] for e in examples])}


def train(
    teacher: Any,
    out: Path,
    *,
    steps: int = 10,
    batch_size: int = 4,
    seq_len: int = 32,
    top_k: int = 16,
    lr: float = 3e-3,
    record: Path | None = None,
    fused: bool = False,
) -> Any:
    """Distil for ``steps`` optimizer steps (``batch_size`` sequences per process); return
    the trainer (closed: its clients are closed, ``trainer.model`` and
    ``trainer.state.log_history`` are kept)."""
    from transformers import TrainingArguments

    from student_client.integrations.hf_trainer import DistillationConfig, TopKDistillationTrainer
    from topk_protocol.requests import RequestOptions

    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch",
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    world = args.world_size
    from student_client.clients.blocking import TeacherClient

    with TeacherClient(teacher) as info_client:  # the student's vocabulary: the teacher's
        vocab_size = info_client.info().vocab_size
    trainer = TopKDistillationTrainer(
        model=student(vocab_size),
        args=args,
        train_dataset=window_examples(steps * batch_size * world, seq_len, vocab_size),
        data_collator=_collate,
        teacher=teacher,
        distill=DistillationConfig(RequestOptions(top_k), prefetch_depth=2, fused=fused),
        teacher_kwargs=None if record is None else {"record_to": record},
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def main(argv: list[str] | None = None) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="teacher target, host:port")
    ap.add_argument("--out", type=Path, default=Path("runs/trainer_distill"))
    ap.add_argument("--record", type=Path, help="record each rank's payloads under this dir")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per process and step")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--fused", action="store_true", help="fused lm_head loss")
    args = ap.parse_args(argv)
    trainer = train(
        args.teacher,
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        top_k=args.top_k,
        record=args.record,
        fused=args.fused,
    )
    rank = trainer.args.process_index
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.save(model.state_dict(), args.out / f"rank{rank}.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps(trainer.state.log_history))
    return trainer


if __name__ == "__main__":
    main()
