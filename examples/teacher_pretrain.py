"""The demo's default teacher: a tiny byte-level Qwen2, pretrained once on CPU and cached;
and, with ``--tokenizer bpe``, a teacher with a real-sized (BPE) vocabulary.

There is no model hub here, and a random model's next-token distribution is nearly
uniform, so the demo trains its own teacher (docs/vllm.md): Qwen2 architecture
(vocab 320 = 258 byte-tokenizer ids padded, hidden 128, 2 layers, 2 heads, 1 KV head,
head_dim 64, ~0.5M parameters), AdamW, ``[16, 256]`` byte windows of the Python standard
library's sources (:mod:`examples.data`), for a wall-clock budget (90 s by default).
The result is a normal model directory (``config.json``, ``model.safetensors``, the byte
tokenizer) that vLLM and transformers load.

    python -m examples.teacher_pretrain --out .cache/topk-distill/teacher-v1 --seconds 90

A byte vocabulary is too small for questions about the tail of the distribution (which
payload keeps enough of it). ``--tokenizer bpe`` first trains a byte-level BPE tokenizer of
``--vocab-size`` ids (default 8192) on the training files
(:func:`devtools.tiny_model.train_bpe_tokenizer`), then the same model on the corpus in
those tokens (:func:`bpe_teacher_config` has its defaults; cached at
:data:`BPE_CACHE_DIR`; :func:`teacher_corpus` re-tokenizes the corpus for a cached one):

    python -m examples.teacher_pretrain --tokenizer bpe --out .cache/topk-distill/teacher-bpe8k-v1

:func:`build_default_teacher` returns a cached directory when it is complete: the marker
file :data:`MARKER_NAME` (config + metrics JSON) is written last, and the directory is
moved into place in one rename, so a half-written teacher is never mistaken for one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.data import (
    NUM_TOKENS,
    ByteCorpus,
    WindowSampler,
    fixed_windows,
    load_stdlib_corpus,
    split_documents,
    tokenize_corpus,
)

__all__ = [
    "BPE_CACHE_DIR",
    "DEFAULT_CACHE_DIR",
    "MARKER_NAME",
    "PretrainConfig",
    "bpe_teacher_config",
    "build_default_teacher",
    "build_parser",
    "evaluate",
    "main",
    "pretrain_teacher",
    "read_marker",
    "teacher_corpus",
    "teacher_model_config",
]

log = logging.getLogger(__name__)

#: Where the demo keeps its teacher (relative to the working directory).
DEFAULT_CACHE_DIR = Path(".cache/topk-distill/teacher-v1")
#: Where the BPE-vocabulary teacher of :func:`bpe_teacher_config` is kept.
BPE_CACHE_DIR = Path(".cache/topk-distill/teacher-bpe8k-v1")
#: The tokenizers a teacher can be trained with.
TOKENIZERS = ("byte", "bpe")
#: Written last into a finished teacher directory: ``{"config": ..., "metrics": ...}``.
MARKER_NAME = "pretrain.json"
#: Files a finished teacher directory must hold besides the marker.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PretrainConfig:
    """Everything that decides the teacher (recorded in the marker file)."""

    train_seconds: float = 90.0
    #: Stop after this many steps even if time is left (None: time budget only). With a
    #: step limit and no time limit reached, a run is reproducible from ``seed``.
    max_steps: int | None = None
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    vocab_size: int = 320
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 4096
    eval_windows: int = 64
    threads: int = 2
    #: Read at most this many corpus bytes (None: all of it).
    corpus_max_bytes: int | None = None
    #: "byte" (ids 0..255 the bytes) or "bpe" (a byte-level BPE of ``vocab_size`` ids
    #: learned from the training files first).
    tokenizer: str = "byte"

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer: must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.vocab_size < NUM_TOKENS:
            raise ValueError(f"vocab_size: must be >= {NUM_TOKENS}, got {self.vocab_size}")
        if self.train_seconds <= 0 and self.max_steps is None:
            raise ValueError("train_seconds: must be > 0 unless max_steps is given")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1, got {self.max_steps}")
        for name in ("batch_size", "seq_len", "eval_windows", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


def bpe_teacher_config(**overrides: Any) -> PretrainConfig:
    """The BPE teacher's defaults: 8192 ids, windows of 128 tokens (about 460 bytes), 300
    steps of 16 windows (0.6M of the training files' 2.9M tokens) with no time limit, so
    that the teacher is the same on every machine (a few minutes on 2 cores)."""
    fields: dict[str, Any] = dict(
        tokenizer="bpe", vocab_size=8192, train_seconds=0.0, max_steps=300, seq_len=128
    )
    return PretrainConfig(**{**fields, **overrides})


def teacher_model_config(cfg: PretrainConfig) -> Any:
    """The ``transformers.Qwen2Config`` of the teacher."""
    from devtools.tiny_model import tiny_qwen2_config

    return tiny_qwen2_config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=0.02,
    )


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16
) -> dict[str, float]:
    """Next-token cross-entropy (nats/token: per byte for the byte tokenizer) and mean
    top-8 / top-16 probability mass over every position of ``windows`` ``[N, T+1]``
    (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    was_training = model.training
    model.eval()
    nll = top8 = top16 = 0.0
    count = 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        target = chunk[:, 1:]
        nll += float(-logp.gather(-1, target[..., None]).sum())
        top = logp.topk(16, dim=-1).values.exp()
        top8 += float(top[..., :8].sum())
        top16 += float(top.sum())
        count += target.numel()
    model.train(was_training)
    return {"ce": nll / count, "top8_mass": top8 / count, "top16_mass": top16 / count}


def _unigram_ce(corpus: ByteCorpus, vocab_size: int) -> float:
    """Held-out CE of the train split's token frequencies (add-one): the no-context
    baseline."""
    counts = np.bincount(corpus.train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[corpus.heldout].mean())


def _lr_at(cfg: PretrainConfig, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay over the budget's progress (0..1) to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tokenizer_for(cfg: PretrainConfig, corpus: ByteCorpus) -> Any:
    """The byte tokenizer, or a BPE of ``cfg.vocab_size`` ids learned from the training
    files of ``corpus`` (a byte corpus)."""
    from devtools.tiny_model import byte_tokenizer, train_bpe_tokenizer

    if cfg.tokenizer == "byte":
        return byte_tokenizer()
    texts = (doc.decode("utf-8", "replace") for doc in split_documents(corpus.train))
    return train_bpe_tokenizer(texts, cfg.vocab_size)


def teacher_corpus(teacher_dir: str | Path, corpus: ByteCorpus | None = None) -> ByteCorpus:
    """The corpus in the tokens of the teacher at ``teacher_dir``: ``corpus`` (default:
    the stdlib sources as the teacher's marker read them) as it is for a byte-level
    teacher, re-tokenized (:func:`examples.data.tokenize_corpus`) for a BPE one."""
    marker = read_marker(teacher_dir)
    if marker is None:
        raise FileNotFoundError(f"teacher_dir: {teacher_dir} is not a complete teacher")
    config = marker.get("config", {})
    corpus = corpus or load_stdlib_corpus(max_bytes=config.get("corpus_max_bytes"))
    if config.get("tokenizer", "byte") == "byte":
        return corpus
    from transformers import AutoTokenizer

    return tokenize_corpus(corpus, AutoTokenizer.from_pretrained(teacher_dir))


def pretrain_teacher(
    out: str | Path, cfg: PretrainConfig | None = None, *, corpus: ByteCorpus | None = None
) -> dict[str, Any]:
    """Train a teacher into ``out`` (weights, config, tokenizer) and return its metrics.
    ``corpus`` is a byte corpus (BPE teachers re-tokenize it). Does not write the marker
    file (see :func:`build_default_teacher`)."""
    from transformers import Qwen2ForCausalLM

    cfg = cfg or PretrainConfig()
    byte_corpus = corpus or load_stdlib_corpus(max_bytes=cfg.corpus_max_bytes)
    tokenizer = _tokenizer_for(cfg, byte_corpus)
    corpus = byte_corpus if cfg.tokenizer == "byte" else tokenize_corpus(byte_corpus, tokenizer)
    out = Path(out)
    with _torch_threads(cfg.threads):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(teacher_model_config(cfg))
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        eval_set = fixed_windows(corpus.heldout, length=cfg.seq_len + 1, count=cfg.eval_windows)
        initial = evaluate(model, eval_set)
        log.info("teacher: %d parameters, initial held-out CE %.3f", n_params, initial["ce"])
        sampler = WindowSampler(
            corpus.train, batch_size=cfg.batch_size, length=cfg.seq_len + 1, seed=cfg.seed
        )
        optim = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        step, t0, last_log = 0, time.monotonic(), time.monotonic()
        first_loss = last_loss = float("nan")
        while True:
            elapsed = time.monotonic() - t0
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
            if cfg.train_seconds > 0 and elapsed >= cfg.train_seconds:
                break
            progress = max(
                elapsed / cfg.train_seconds if cfg.train_seconds > 0 else 0.0,
                step / cfg.max_steps if cfg.max_steps else 0.0,
            )
            for group in optim.param_groups:
                group["lr"] = _lr_at(cfg, step, progress)
            batch = sampler.sample()
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)
            )
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optim.step()
            last_loss = loss.item()
            if step == 0:
                first_loss = last_loss
            step += 1
            if time.monotonic() - last_log >= 15:
                last_log = time.monotonic()
                log.info("step %d, %.0f s, train loss %.3f", step, last_log - t0, last_loss)
        train_s = time.monotonic() - t0
        final = evaluate(model, eval_set)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    bytes_per_token = len(byte_corpus.heldout) / len(corpus.heldout)
    metrics: dict[str, Any] = {
        "parameters": n_params,
        "steps": step,
        "train_seconds": round(train_s, 2),
        "train_tokens": step * cfg.batch_size * cfg.seq_len,
        "steps_per_second": round(step / train_s, 3) if train_s > 0 else 0.0,
        "first_train_loss": first_loss if step else None,
        "last_train_loss": last_loss if step else None,
        "initial_heldout_ce": initial["ce"],
        "heldout_ce": final["ce"],
        "heldout_top8_mass": final["top8_mass"],
        "heldout_top16_mass": final["top16_mass"],
        "heldout_unigram_ce": _unigram_ce(corpus, cfg.vocab_size),
        "heldout_eval_tokens": cfg.eval_windows * cfg.seq_len,
        "heldout_bytes_per_token": round(bytes_per_token, 4),
        "corpus": corpus.describe(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    log.info(
        "teacher: %d steps in %.0f s, held-out CE %.3f nats/token (initial %.3f), "
        "top-8 mass %.3f, top-16 mass %.3f",
        step,
        train_s,
        final["ce"],
        initial["ce"],
        final["top8_mass"],
        final["top16_mass"],
    )
    return metrics


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The marker of a complete teacher directory, or None if ``path`` is not one."""
    root = Path(path)
    try:
        marker = json.loads((root / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not all((root / f).is_file() for f in REQUIRED_FILES):
        return None
    return marker


def build_default_teacher(
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    train_seconds: float = 90.0,
    seed: int = 0,
    *,
    config: PretrainConfig | None = None,
    force: bool = False,
    corpus: ByteCorpus | None = None,
) -> Path:
    """The teacher directory at ``cache_dir``, trained first unless it is already there.

    A complete directory (see :func:`read_marker`) is returned as it is, whatever budget
    it was built with (its marker says). ``config`` overrides ``train_seconds`` and
    ``seed``; ``corpus`` is what it trains on (default: the stdlib sources). ``force``
    rebuilds. A non-empty ``cache_dir`` that is not a complete teacher is an error, never
    deleted.
    """
    target = Path(cache_dir)
    if force and read_marker(target) is not None:
        shutil.rmtree(target)
    marker = read_marker(target)
    if marker is not None:
        log.info("teacher: using the cached %s (%s)", target, _summary(marker))
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(
            f"cache_dir: {target} exists but is not a complete teacher directory "
            f"(no valid {MARKER_NAME}); remove it or choose another"
        )
    cfg = config or PretrainConfig(train_seconds=train_seconds, seed=seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        metrics = pretrain_teacher(tmp, cfg, corpus=corpus)
        marker = {"config": asdict(cfg), "metrics": metrics}
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the server may run as another user
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()  # an empty directory (e.g. a fresh volume mount point)
        try:
            os.rename(tmp, target)
        except OSError:
            if read_marker(target) is None:  # not another builder that finished first
                raise
            log.info("teacher: another process finished %s first; using it", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _summary(marker: dict[str, Any]) -> str:
    m = marker.get("metrics", {})
    try:
        return (
            f"held-out CE {m['heldout_ce']:.3f} nats/token, top-8 mass "
            f"{m['heldout_top8_mass']:.3f}, {m['steps']} steps in {m['train_seconds']:.0f} s"
        )
    except (KeyError, TypeError, ValueError):
        return "no metrics"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m examples.teacher_pretrain``."""
    ap = argparse.ArgumentParser(
        prog="python -m examples.teacher_pretrain",
        description="Build (or reuse) the demo's tiny byte-level teacher, or a BPE one.",
    )
    ap.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default="byte",
        help="byte (the demo's teacher) or bpe (a BPE vocabulary learned first; other "
        "defaults from bpe_teacher_config)",
    )
    ap.add_argument(
        "--out", type=Path, help=f"teacher directory (default {DEFAULT_CACHE_DIR}, "
        f"or {BPE_CACHE_DIR} for bpe)",
    )  # fmt: skip
    ap.add_argument("--seconds", type=float, help="training wall-clock budget (0: none)")
    ap.add_argument(
        "--steps", type=int, help="stop after this many steps (reproducible from --seed)"
    )
    ap.add_argument("--vocab-size", type=int, help="model vocabulary (bpe: the tokenizer's)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    return ap


#: Command-line option -> ``PretrainConfig`` field, for the options given.
_CONFIG_OPTIONS = {
    "seconds": "train_seconds",
    "steps": "max_steps",
    "vocab_size": "vocab_size",
    "seed": "seed",
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "lr": "lr",
    "threads": "threads",
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    given = {
        name: getattr(args, opt)
        for opt, name in _CONFIG_OPTIONS.items()
        if getattr(args, opt) is not None
    }
    bpe = args.tokenizer == "bpe"
    cfg = bpe_teacher_config(**given) if bpe else PretrainConfig(**given)
    out = args.out or (BPE_CACHE_DIR if bpe else DEFAULT_CACHE_DIR)
    out = build_default_teacher(out, config=cfg, force=args.force)
    marker = read_marker(out)
    print(json.dumps({"teacher": str(out), **(marker or {})}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
