"""Distil a small student from a teacher served over gRPC (or from a recording).

The student (a fresh Qwen2, smaller than the teacher) reads byte windows of the Python
standard library's sources; for every window the teacher's top-k next-byte distribution
comes through :class:`~student_client.clients.blocking.TeacherClient` with prefetch, and the student
minimises a divergence of the coarse-grained top-k distributions (``--divergence
forward|reverse|jsd [--beta B]``, default the forward KL; ``--mode tail|truncated|
tail_actual``, default the tail-aware K+1 categories; ``tail_actual`` gives the actual next
byte its own category), by default through the fused lm_head loss (``lm_head_topk_kl_loss``
on the last hidden states: the student's logits are never formed; ``--no-fused`` computes
logits and uses ``topk_kl_loss``). Before and after, on held-out files, it
measures the student's cross-entropy and the full-vocabulary KL(teacher || student) and
KL(student || teacher) (the teacher's weights are read locally for that, from
``--teacher-dir``), next to the
teacher's own cross-entropy, prints a table, and writes a PNG of the training curves.

    python -m examples.distill --teacher 127.0.0.1:50051 [--steps 300] [--out runs/distill]
    python -m examples.distill --teacher 127.0.0.1:50051 --record runs/recording
    python -m examples.distill --replay runs/recording
    python -m examples.distill --dataset runs/recording    # shuffled DataLoader, many epochs
    python -m examples.distill --teacher 127.0.0.1:50051 --loss-mode truncated --no-fused
    python -m examples.distill --teacher HOST:PORT --divergence jsd --beta 0.5 --mode tail_actual

With ``--teacher-temperature T`` (the teacher serving at ``T``: ``teacher-server serve
--teacher-temperature T``) the client refuses a teacher at another temperature, the loss
tempers the student by the same ``T`` and is scaled by ``T**2``; the held-out metrics
stay at temperature 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from examples.data import ByteCorpus, WindowSampler, fixed_windows, load_stdlib_corpus
from examples.teacher_pretrain import DEFAULT_CACHE_DIR
from student_client.losses import (
    DIVERGENCES,
    LossOptions,
    TeacherTargets,
    TopKKLStats,
    causal_lm_hidden_and_head,
    get_divergence,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.types import LossMode

__all__ = ["DistillConfig", "evaluate", "heldout_table", "main", "run_distill", "student_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    """Everything that decides a distillation run."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 256
    top_k: int = 16
    depth: int = 4
    lr: float = 3e-3
    seed: int = 0
    eval_windows: int = 32
    eval_every: int = 50
    hidden_size: int = 64
    num_layers: int = 1
    threads: int = 2
    loss_mode: LossMode = "tail"
    divergence: str = "forward"
    beta: float | None = None
    # The fused lm_head loss by default, as the rule of docs/lm_head_loss.md ("Which path") says:
    # it never needs more memory than the logits path, and with N = 16 x 256 positions per
    # step and a byte vocabulary the logits (2NV, about 2 MiB) fit one 64 MiB block: the
    # rule's one-block case (no extra pass over [V, H], less elementwise work).
    fused: bool = True
    teacher_temperature: float = 1.0


@dataclass
class EvalResult:
    """Held-out metrics in nats per byte (averaged over every predicted position)."""

    student_ce: float
    kl_teacher_student: float
    teacher_ce: float
    kl_student_teacher: float = math.nan
    #: KL(student || teacher) per token of the student's own continuations of held-out
    #: prompts (the on-policy metric, examples/onpolicy_eval.py); NaN when not measured.
    onpolicy_kl: float = math.nan


@dataclass
class RunResult:
    before: EvalResult
    after: EvalResult
    curve_steps: list[int] = field(default_factory=list)
    curve_kl: list[float] = field(default_factory=list)
    curve_ce: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    train_overlap: list[float] = field(default_factory=list)
    teacher_mass: float = 0.0
    seconds: float = 0.0
    positions_per_s: float = 0.0


def student_model(vocab_size: int, cfg: DistillConfig) -> Any:
    """A fresh ``Qwen2ForCausalLM`` smaller than the teacher (same vocabulary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 2,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=cfg.hidden_size // 2,
        max_position_embeddings=max(1024, cfg.seq_len),
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(Qwen2Config(**fields))


@torch.inference_mode()
def evaluate(student: Any, teacher: Any, windows: torch.Tensor, batch: int = 8) -> EvalResult:
    """Held-out metrics on ``windows`` ``[N, T]``: cross-entropy of x[t+1] for both models
    and the full-vocabulary KL(teacher || student) and KL(student || teacher) at every
    position."""
    student.eval()
    ce_s = ce_t = kl = reverse = 0.0
    n_ce = n_kl = 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        ls = torch.log_softmax(student(input_ids=x).logits.float(), -1)  # [b, T, V]
        lt = torch.log_softmax(teacher(input_ids=x).logits.float(), -1)
        v = min(ls.shape[-1], lt.shape[-1])
        ls, lt = ls[..., :v], lt[..., :v]
        target = x[:, 1:, None]
        ce_s -= ls[:, :-1].gather(-1, target).sum().item()
        ce_t -= lt[:, :-1].gather(-1, target).sum().item()
        n_ce += target.numel()
        kl += (lt.exp() * (lt - ls)).sum().item()
        reverse += (ls.exp() * (ls - lt)).sum().item()
        n_kl += x.numel()
    student.train()
    return EvalResult(ce_s / n_ce, kl / n_kl, ce_t / n_ce, reverse / n_kl)


def distill_loss(student: Any, x: torch.Tensor, payload: Any, cfg: DistillConfig) -> Any:
    """The step's loss and stats: fused on the last hidden states, or on the logits."""
    actual = cfg.loss_mode == "tail_actual"  # the next tokens come from x
    if actual and payload.sampled_logprobs is None:
        raise SystemExit("--mode tail_actual: the payload has no sampled log-probs")
    teacher = TeacherTargets.from_payload(payload, input_ids=x if actual else None)
    if cfg.fused:
        head = causal_lm_hidden_and_head(student, input_ids=x)  # [B, T, H], [V, H]
        result: tuple[torch.Tensor, TopKKLStats] = lm_head_topk_kl_loss(
            (head.weight, head.bias), head.hidden, teacher, loss_options(cfg)
        )
        return result
    logits = student(input_ids=x).logits  # [B, T, V]
    return topk_kl_loss(logits, teacher, loss_options(cfg))


def loss_options(cfg: DistillConfig) -> LossOptions:
    """The run's loss options: divergence (with ``beta`` for the JSD), mode, temperature."""
    params = {} if cfg.beta is None else {"beta": cfg.beta}
    return LossOptions(
        divergence=get_divergence(cfg.divergence, **params),
        mode=cfg.loss_mode,
        overlap=True,
        temperature=cfg.teacher_temperature,
    )


def _open_client(args: argparse.Namespace, vocab_size: int) -> Any:
    if args.replay:
        from student_client.offline.replay_client import ReplayClient

        return ReplayClient(
            args.replay, expect_vocab_size=vocab_size, expect_temperature=args.teacher_temperature
        )
    from student_client.clients.blocking import TeacherClient

    return TeacherClient(
        args.teacher,
        token=args.token,
        expect_vocab_size=vocab_size,
        expect_temperature=args.teacher_temperature,
        record_to=args.record,
    )


def _dataset_batches(path: Path, cfg: DistillConfig, vocab_size: int) -> Iterator[Any]:
    """``(tokens [B, T], payload)`` for ``cfg.steps`` steps from a payload dataset
    (``PayloadDataset``: a recording), shuffled, epoch after epoch, no teacher."""
    from torch.utils.data import DataLoader

    from student_client.offline.dataset import PayloadDataset, collate_payloads

    ds = PayloadDataset(path, top_k=cfg.top_k)
    if ds.vocab_size != vocab_size:
        raise SystemExit(f"--dataset: vocab_size {ds.vocab_size}, the student has {vocab_size}")
    if ds.reader.temperature != cfg.teacher_temperature:
        raise SystemExit(
            f"--dataset: teacher_temperature {ds.reader.temperature:g} (recorded), "
            f"--teacher-temperature is {cfg.teacher_temperature:g}"
        )
    loader = DataLoader(
        ds,
        batch_size=cfg.batch_size,
        shuffle=True,
        num_workers=2,
        collate_fn=collate_payloads,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    step = 0
    while True:
        for batch in loader:
            if bool((batch.payload.position_start != 0).any()):
                raise SystemExit("--dataset: rows must hold every position (start 0)")
            yield batch.token_ids, batch.payload
            step += 1
            if step == cfg.steps:
                return


@contextlib.contextmanager
def _training_batches(
    args: argparse.Namespace, cfg: DistillConfig, vocab_size: int, batches: list[torch.Tensor]
) -> Iterator[Iterator[Any]]:
    """``(tokens, payload)`` per step: the sampled windows with the teacher's (or a
    recording's) payloads, prefetched; or a payload dataset's shuffled batches."""
    if args.dataset:
        yield _dataset_batches(args.dataset, cfg, vocab_size)
        return
    with _open_client(args, vocab_size) as client:
        payloads: Iterator[Any] = client.stream(batches, cfg.top_k, depth=cfg.depth)
        yield zip(batches, payloads, strict=True)


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="distill", unit="step", file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is in the dev extra
        return None


def run_distill(args: argparse.Namespace, cfg: DistillConfig) -> RunResult:
    """Train the student against the teacher and return before/after metrics and curves."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.threads)
    corpus: ByteCorpus = load_stdlib_corpus()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher_dir, dtype=torch.float32).eval()
    vocab = int(teacher.config.vocab_size)
    student = student_model(vocab, cfg)
    heldout = fixed_windows(corpus.heldout, length=cfg.seq_len, count=cfg.eval_windows)
    before = evaluate(student, teacher, heldout)
    result = RunResult(before=before, after=before)
    result.curve_steps.append(0)
    result.curve_kl.append(before.kl_teacher_student)
    result.curve_ce.append(before.student_ce)

    sampler = WindowSampler(
        corpus.train, batch_size=cfg.batch_size, length=cfg.seq_len, seed=cfg.seed
    )
    # The same windows go to the teacher (ahead, prefetched) and to the student.
    batches = [sampler.sample() for _ in range(cfg.steps)]
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1
    )
    bar = _progress(cfg.steps)
    t0 = time.perf_counter()
    mass = 0.0
    with _training_batches(args, cfg, vocab, batches) as pairs:
        for step, (x, payload) in enumerate(pairs, start=1):
            loss, stats = distill_loss(student, x, payload, cfg)
            opt.zero_grad(set_to_none=True)
            (loss * cfg.teacher_temperature**2).backward()  # T**2: the gradient scale of T = 1
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            result.train_loss.append(loss.item())
            result.train_overlap.append(stats.overlap)
            mass += stats.teacher_mass
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", overlap=f"{stats.overlap:.2f}")
                bar.update()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                ev = evaluate(student, teacher, heldout)
                result.curve_steps.append(step)
                result.curve_kl.append(ev.kl_teacher_student)
                result.curve_ce.append(ev.student_ce)
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - t0
    result.positions_per_s = cfg.steps * cfg.batch_size * cfg.seq_len / result.seconds
    result.teacher_mass = mass / max(cfg.steps, 1)
    result.after = evaluate(student, teacher, heldout)
    return result


_LOSS_LABELS = {"tail": "tail-aware", "truncated": "truncated", "tail_actual": "tail + actual"}


def heldout_table(before: EvalResult, after: EvalResult, windows: int, length: int) -> list[str]:
    """Before/after held-out metrics as markdown lines (shared with examples/onpolicy.py)."""
    b, a = before, after
    drop = 100 * (1 - a.kl_teacher_student / b.kl_teacher_student)
    return [
        f"held-out: {windows} windows x {length} bytes of stdlib files the "
        f"teacher never trained on; nats per byte",
        "",
        "| metric | before | after |",
        "|---|---:|---:|",
        f"| student cross-entropy | {b.student_ce:.3f} | {a.student_ce:.3f} |",
        f"| KL(teacher \\|\\| student), full vocabulary | {b.kl_teacher_student:.3f} | "
        f"{a.kl_teacher_student:.3f} ({drop:.0f}% lower) |",
        f"| KL(student \\|\\| teacher), full vocabulary | {b.kl_student_teacher:.3f} | "
        f"{a.kl_student_teacher:.3f} |",
        f"| teacher cross-entropy (reference) | {b.teacher_ce:.3f} | {a.teacher_ce:.3f} |",
    ]


def describe_divergence(cfg: DistillConfig) -> str:
    """``forward KL``, ``reverse KL``, ``JSD(beta=0.5)``."""
    if cfg.divergence == "jsd":
        return f"JSD(beta={0.5 if cfg.beta is None else cfg.beta:g})"
    return f"{cfg.divergence} KL"


def format_table(result: RunResult, cfg: DistillConfig) -> str:
    """The before/after table (markdown)."""
    rows = [
        *heldout_table(result.before, result.after, cfg.eval_windows, cfg.seq_len),
        "",
        f"{cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} positions, top-{cfg.top_k} "
        f"{_LOSS_LABELS[cfg.loss_mode]} {describe_divergence(cfg)} "
        f"({'fused lm_head' if cfg.fused else 'on logits'}; "
        f"teacher top-{cfg.top_k} mass {result.teacher_mass:.2f}), prefetch "
        f"depth {cfg.depth}: {result.seconds:.0f} s, {result.positions_per_s:,.0f} positions/s",
    ]
    if cfg.teacher_temperature != 1.0:
        rows.append(
            f"teacher and student loss at temperature T = {cfg.teacher_temperature:g} "
            "(loss x T^2); held-out metrics at T = 1"
        )
    return "\n".join(rows)


def plot(result: RunResult, path: Path) -> None:
    """Training loss and held-out KL / cross-entropy curves, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, len(result.train_loss) + 1)
    ax1.plot(steps, result.train_loss, lw=0.8, label="top-k KL (train batch)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("nats / position")
    ax1.set_title("training loss")
    ax1.legend()
    ax2.plot(result.curve_steps, result.curve_kl, "o-", label="KL(teacher || student)")
    ax2.plot(result.curve_steps, result.curve_ce, "s-", label="student cross-entropy")
    ax2.axhline(result.before.teacher_ce, ls="--", c="gray", label="teacher cross-entropy")
    ax2.set_xlabel("step")
    ax2.set_ylabel("nats / byte (held-out)")
    ax2.set_title("held-out")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m examples.distill", description=__doc__.split("\n\n")[0]
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--teacher", help="teacher target: host:port, dns:///name:port, or a,b,c")
    src.add_argument("--replay", type=Path, help="train against a recording instead")
    src.add_argument(
        "--dataset", type=Path, help="train on a payload dataset (a recording), shuffled"
    )
    ap.add_argument("--record", type=Path, help="record the teacher's payloads to this directory")
    ap.add_argument(
        "--token",
        default=os.environ.get("TOPK_TEACHER_TOKEN"),
        help="bearer token of the teacher (default: $TOPK_TEACHER_TOKEN)",
    )
    ap.add_argument(
        "--teacher-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="the teacher's weights, read locally for the full-vocabulary evaluation",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/distill"))
    d = DistillConfig()
    for name in ("steps", "batch_size", "seq_len", "top_k", "depth", "seed", "eval_windows"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument(
        "--mode",
        "--loss-mode",
        dest="loss_mode",
        choices=list(_LOSS_LABELS),
        default=d.loss_mode,
        help="tail (K+1 categories), truncated (verl; forward KL only) or tail_actual "
        "(K+2: the actual next byte's own category)",
    )
    ap.add_argument(
        "--divergence",
        choices=list(DIVERGENCES),
        default=d.divergence,
        help="forward KL(teacher || student), reverse KL(student || teacher), or "
        "generalized JSD (see --beta)",
    )
    ap.add_argument(
        "--beta",
        type=float,
        default=d.beta,
        help="JSD only: mixture weight of the teacher, m = beta p + (1 - beta) q "
        "(0: forward KL, 1: reverse KL; default 0.5)",
    )
    ap.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=d.fused,
        help="fused lm_head loss on the last hidden states (default); --no-fused: logits",
    )
    ap.add_argument(
        "--teacher-temperature",
        type=float,
        default=d.teacher_temperature,
        help="temperature the teacher serves at (checked) and the loss tempers the student by",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.record and args.replay:
        raise SystemExit("--record and --replay exclude each other")
    logging.basicConfig(level=logging.WARNING)
    cfg = DistillConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        top_k=args.top_k,
        depth=args.depth,
        seed=args.seed,
        eval_windows=args.eval_windows,
        eval_every=args.eval_every,
        lr=args.lr,
        loss_mode=args.loss_mode,
        divergence=args.divergence,
        beta=args.beta,
        fused=args.fused,
        teacher_temperature=args.teacher_temperature,
    )
    result = run_distill(args, cfg)
    table = format_table(result, cfg)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "training_curves.png")
    (args.out / "result.json").write_text(
        json.dumps({"config": asdict(cfg), "result": asdict(result)}, indent=2) + "\n"
    )
    print(f"\nplot: {args.out / 'training_curves.png'}   metrics: {args.out / 'result.json'}")
    if not math.isfinite(result.after.kl_teacher_student):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
