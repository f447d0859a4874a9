"""Distil a student whose tokenizer is not the teacher's (docs/cross_tokenizer.md).

The teacher (a BPE teacher of ``examples.teacher_pretrain``, 512 ids) serves another BPE,
of 400 ids learned from the same training files, as a student tokenizer::

    python -m examples.teacher_pretrain --tokenizer bpe --vocab-size 512 --out runs/t
    python -m examples.cross_tokenizer --write-tokenizer runs/student-tok
    teacher-server serve --backend vllm --model runs/t \\
        --student-tokenizer code=runs/student-tok
    python -m examples.cross_tokenizer --teacher 127.0.0.1:50051 \\
        --student-tokenizer code --tokenizer-dir runs/student-tok [--steps 60]

Tokenizers of a like grain share most token ends, so most rows are exact; a student much
finer or coarser than its teacher gets a target of another event at every row (a byte
teacher's "the next token is h" given to a student's one-byte token ``h``), which lowers
the distillation loss while its own cross-entropy may rise (docs/cross_tokenizer.md).

The student, a fresh Qwen2 of its BPE's vocabulary, reads windows of the training files
in its own tokens; ``TeacherClient(..., student_tokenizer="code")`` sends those ids and
gets the teacher's rows in them (rows that end inside a teacher token come back masked
and the loss skips them). It minimises the tail-aware top-k KL (``topk_kl_loss``). Before
and after, on held-out windows, it measures the same loss against the teacher's
answers, and the student's own cross-entropy; ``result.json`` in ``--out`` holds both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.data import ByteCorpus, load_stdlib_corpus, split_documents
from student_client import TeacherClient
from student_client.data.payload import TeacherPayload
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss

__all__ = ["main", "write_student_tokenizer"]


def write_student_tokenizer(path: str | Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE of ``vocab_size`` ids learned from the corpus's training files,
    saved to ``path`` (what ``--student-tokenizer NAME=path`` loads)."""
    from devtools.tiny_model import train_bpe_tokenizer

    corpus = load_stdlib_corpus(max_bytes=2_000_000)
    texts = (d.decode("utf-8", "replace") for d in split_documents(corpus.train))
    out = Path(path)
    train_bpe_tokenizer(texts, vocab_size).save_pretrained(out)
    return out


def text_windows(stream: np.ndarray, count: int, size: int, rng: np.random.Generator) -> list[str]:
    """``count`` texts of about ``size`` bytes cut from a byte corpus stream (its
    document separators and a character split at either end dropped)."""
    starts = rng.integers(0, len(stream) - size, count)
    pieces = (stream[s : s + size] for s in starts)
    return [p[p < 256].astype(np.uint8).tobytes().decode("utf-8", "ignore") for p in pieces]


def student_model(vocab_size: int, seed: int) -> Any:
    from transformers import Qwen2ForCausalLM

    from devtools.tiny_model import tiny_qwen2_config

    torch.manual_seed(seed)
    config = tiny_qwen2_config(vocab_size=vocab_size, hidden_size=64, num_layers=2)
    return Qwen2ForCausalLM(config)


def kd_loss(
    model: Any, batch: dict[str, torch.Tensor], payload: TeacherPayload, opts: LossOptions
) -> torch.Tensor:
    logits = model(**batch).logits
    loss, _ = topk_kl_loss(logits, TeacherTargets.from_payload(payload), opts)
    return loss


@torch.no_grad()
def evaluate(
    model: Any,
    batches: list[tuple[dict[str, torch.Tensor], TeacherPayload]],
    opts: LossOptions,
) -> dict[str, float]:
    """Held-out KD loss (mean over batches) and the student's cross-entropy."""
    model.eval()
    kd, ce = [], []
    for batch, payload in batches:
        kd.append(float(kd_loss(model, batch, payload, opts)))
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        ce.append(float(model(**batch, labels=labels).loss))
    model.train()
    return {"kd_loss": float(np.mean(kd)), "student_ce": float(np.mean(ce))}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-tokenizer", metavar="DIR", help="write the student tokenizer, exit")
    ap.add_argument("--teacher", help="the teacher's gRPC target")
    ap.add_argument("--student-tokenizer", default="code", help="its name on the teacher")
    ap.add_argument("--tokenizer-dir", help="the student tokenizer's directory")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--window-bytes", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/cross_tokenizer")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.write_tokenizer:
        print(f"wrote {write_student_tokenizer(a.write_tokenizer)}")
        return 0
    if not (a.teacher and a.tokenizer_dir):
        raise SystemExit("cross_tokenizer: --teacher and --tokenizer-dir are needed")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer_dir)
    corpus: ByteCorpus = load_stdlib_corpus(max_bytes=2_000_000)
    rng = np.random.default_rng(a.seed)
    opts = LossOptions(chunk_size=256)
    model = student_model(len(tokenizer), a.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def encode(texts: list[str]) -> dict[str, torch.Tensor]:
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    with TeacherClient(
        a.teacher,
        student_tokenizer=a.student_tokenizer,
        expect_vocab_size=len(tokenizer),
    ) as client:

        def scored(texts: list[str]) -> tuple[dict[str, torch.Tensor], TeacherPayload]:
            batch = encode(texts)
            return batch, client.score(batch, a.top_k, dtype="float32")

        eval_rng = np.random.default_rng(a.seed + 1)
        held = [
            scored(text_windows(corpus.heldout, a.batch_size, a.window_bytes, eval_rng))
            for _ in range(max(1, a.eval_windows // a.batch_size))
        ]
        masked = sum(int(p.logprobs[..., 0].isnan().sum()) for _, p in held)
        rows = sum(int(p.mask.sum()) for _, p in held)
        before = evaluate(model, held, opts)
        t0 = time.perf_counter()
        losses = []
        for _ in range(a.steps):
            batch, payload = scored(text_windows(corpus.train, a.batch_size, a.window_bytes, rng))
            loss = kd_loss(model, batch, payload, opts)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        after = evaluate(model, held, opts)
    result = {
        "before": before,
        "after": after,
        "train_loss": losses,
        "heldout_rows": rows,
        "heldout_masked_rows": masked,
        "train_seconds": time.perf_counter() - t0,
    }
    (out / "result.json").write_text(json.dumps({"config": vars(a), "result": result}, indent=2))
    print("| held-out | before | after |")
    print("|---|---:|---:|")
    for key in ("kd_loss", "student_ce"):
        print(f"| {key} | {before[key]:.3f} | {after[key]:.3f} |")
    print(f"masked rows (inside a teacher token): {masked} of {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
