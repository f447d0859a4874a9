"""Hugging Face TRL's ``ServerDistillationTrainer``, unchanged, on a topk-distill teacher.

TRL's trainer generates completions with the student, asks the teacher for their top-k
log-probs through ``trainer.teacher_client.get_sequence_logprobs`` and minimises its
sparse forward KL. The teacher is this project's server: TRL's own client on its HTTP
port (``--teacher-http``), or, with ``--teacher`` too, the gRPC drop-in
:class:`~student_client.integrations.trl_client.TRLTeacherClient` in its place (docs/trl.md).

    teacher-server serve --model DIR --max-top-k 16 ...
    python -m examples.trl_distill --teacher-http http://127.0.0.1:8000 --student DIR
    python -m examples.trl_distill --teacher-http http://127.0.0.1:8000 \
        --teacher 127.0.0.1:50051 --student DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from student_client.integrations.trl_client import TRLTeacherClient


def build_trainer(student: str | Path, teacher_http: str, out: str | Path, **config: Any) -> Any:
    """A ``ServerDistillationTrainer`` on ``student`` (a model directory) that scores with
    the teacher at ``teacher_http``; ``config`` overrides its ``ServerDistillationConfig``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )

    settings: dict[str, Any] = {
        "loss_top_k": 16,
        "beta": 0.0,  # forward KL over the teacher's top 16
        "max_completion_length": 16,
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        **config,
    }
    args = ServerDistillationConfig(
        output_dir=str(out), teacher_model_server_url=teacher_http, **settings
    )
    prompts = ["def add(a, b):", "import os\n", "for i in range(", "class Point:"]
    return ServerDistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(student),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
        processing_class=AutoTokenizer.from_pretrained(student),
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher-http", required=True, help="the teacher's HTTP base URL")
    ap.add_argument("--teacher", help="the teacher's gRPC target: use the drop-in client")
    ap.add_argument("--student", required=True, help="student model directory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/trl_distill")
    args = ap.parse_args(argv)
    trainer = build_trainer(args.student, args.teacher_http, args.out, max_steps=args.steps)
    drop_in = None
    if args.teacher:
        drop_in = trainer.teacher_client = TRLTeacherClient(args.teacher)
    try:
        trainer.train()
    finally:
        if drop_in is not None:
            drop_in.close()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    for entry in logs:
        print(f"step {entry['step']}: loss {entry['loss']:.4f}")
    return logs


if __name__ == "__main__":
    main()
