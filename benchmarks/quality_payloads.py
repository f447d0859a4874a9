"""Which teacher payload distils best per byte? A teacher with a BPE vocabulary, one fresh
student per payload kind, the same steps, windows and seed; held-out full-vocabulary
metrics next to the payload's measured bytes per position and recording time.

Run from the repository root (builds the BPE teacher first if it is not cached,
``examples.teacher_pretrain --tokenizer bpe``)::

    python -m benchmarks.quality_payloads [--steps 150] [--kinds top64-tail top8-tail]
        [--out runs/quality_payloads]

Every step the teacher's transformers forward gives the full log-probs ``[B, T, V]`` of
the step's windows; the payload kind turns them into what a teacher would send
(:attr:`PayloadKind.record`: the real encoded messages, whose size is the bytes per
position), the student side reads the messages back (:attr:`PayloadKind.read`: the values
the student trains on are the decoded ones, float16 rounding included), and the kind's
loss (:attr:`PayloadKind.loss`, fused over the student's lm_head) trains the student.
After the last step, on held-out files: KL(teacher || student), KL(student || teacher)
over the whole vocabulary and the student's cross-entropy (``examples.distill.evaluate``).

**Adding a payload kind** is one :class:`PayloadKind` in :data:`KINDS`: a name, a
``record(log_p [B, T, V], x [B, T], generator) -> Recorded`` (the teacher side: encode the
payload of each window; ``x[:, t + 1]`` is the token after position ``t``, none after the
last), a ``read(recorded) -> dict of tensors`` (the student side: decode), and a
``loss(head, inputs, x) -> scalar`` (``head``: the student's
``student_client.losses.LMHeadInputs``). The kinds: today's top-k (:func:`topk_kind`),
the packed top-k (:func:`packed_kind`) and the sampled payload (:func:`sampled_kind`).

**The scale row** projects each kind to ``SCALE_POSITIONS`` positions at
``SCALE_VOCAB`` ids: bytes per position as measured, plus, for ids stored at
``ceil(log2 V)`` bits (:attr:`Recorded.packed_ids`), ``packed ids per position x
(ceil(log2 SCALE_VOCAB) - ceil(log2 V)) / 8``; recording time as ``record`` measured on
dense log-probs of ``SCALE_VOCAB`` ids (the teacher's forward, which depends on the model,
is left out of that column).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.quality_divergences import teacher_log_probs, topk_payload, train_student
from examples.data import WindowSampler, fixed_windows
from examples.distill import DistillConfig, EvalResult, evaluate, student_model
from examples.teacher_pretrain import (
    BPE_CACHE_DIR,
    bpe_teacher_config,
    build_default_teacher,
    read_marker,
    teacher_corpus,
)
from student_client.losses import (
    LMHeadInputs,
    LossOptions,
    TeacherTargets,
    causal_lm_hidden_and_head,
    lm_head_topk_kl_loss,
)
from student_client.losses.types import LossMode
from topk_protocol import RequestOptions
from topk_protocol.arrays import SequenceArrays
from topk_protocol.codec import decode_sequence, encode_sequence
from topk_protocol.packing import DEFAULT_LOGPROB_BITS
from topk_protocol.sampling import sample_rows, sequence_sample_key

__all__ = [
    "KINDS",
    "SCALE_POSITIONS",
    "SCALE_VOCAB",
    "KindResult",
    "PayloadKind",
    "Recorded",
    "main",
    "packed_kind",
    "projected_bytes",
    "run_kind",
    "sampled_kind",
    "topk_kind",
]

#: The scale row: this many positions ...
SCALE_POSITIONS = 10**9
#: ... of a teacher with this many ids (Qwen2 / Qwen3's vocabulary).
SCALE_VOCAB = 151_936


@dataclass
class Recorded:
    """A batch's payload as the teacher would send it.

    Attributes:
        payload: whatever the kind's ``read`` decodes (for the top-k kinds: one
            ``SequencePayload`` message per window).
        payload_bytes: bytes of the encoded payload (for messages: their ``ByteSize``).
        packed_ids: token ids the payload stores at ``ceil(log2 V)`` bits (0 when ids
            are int32, whose size does not depend on V); the scale row scales these.
    """

    payload: Any
    payload_bytes: int
    packed_ids: int = 0


#: Teacher side: (log_p [B, T, V] float32, x [B, T] int64, generator) -> Recorded.
RecordFn = Callable[[torch.Tensor, torch.Tensor, torch.Generator], Recorded]
#: Student side: Recorded -> the loss's inputs (tensors).
ReadFn = Callable[[Recorded], dict[str, torch.Tensor]]
#: (student's lm_head inputs, read's tensors, x [B, T]) -> scalar loss.
LossFn = Callable[[LMHeadInputs, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PayloadKind:
    """One row of the table: how the teacher's payload is recorded, read and trained on.

    Attributes:
        name: the row's name (``--kinds``).
        label: what the table says about it (payload and loss).
        record, read, loss: see :data:`RecordFn`, :data:`ReadFn`, :data:`LossFn`.
    """

    name: str
    label: str
    record: RecordFn
    read: ReadFn
    loss: LossFn


# -- the top-k kinds -------------------------------------------------------------------------


def _record_topk(
    log_p: torch.Tensor, x: torch.Tensor, generator: torch.Generator, *, options: RequestOptions
) -> Recorded:
    """The top-k messages of a batch: one ``SequencePayload`` per window, in the request's
    dtype, with the next token's log-prob when the request includes it (``generator``
    unused: the top-k is deterministic)."""
    top = topk_payload(log_p, x, options.top_k)
    ids, logprobs, sampled = (top[k].numpy() for k in ("ids", "logprobs", "sampled"))
    packing = options.packing(log_p.shape[-1])
    messages = [
        encode_sequence(
            SequenceArrays(ids[b], logprobs[b], sampled[b] if options.include_sampled else None),
            dtype=options.dtype,
            sequence_index=b,
            packing=packing,
        )
        for b in range(len(ids))
    ]
    packed_ids = ids.size if packing is not None else 0
    return Recorded(messages, sum(m.ByteSize() for m in messages), packed_ids)


def _read_topk(recorded: Recorded) -> dict[str, torch.Tensor]:
    """The decoded messages as ``ids`` / ``logprobs`` ``[B, T, K]`` (and ``sampled``
    ``[B, T]``, ``counts`` ``[B, T, K]`` int64 when sent)."""
    rows = [decode_sequence(m) for m in recorded.payload]
    out = {
        "ids": torch.from_numpy(np.stack([r.ids for r in rows]).astype(np.int64)),
        "logprobs": torch.from_numpy(np.stack([r.logprobs for r in rows])),
    }
    sampled = [r.sampled_logprobs for r in rows if r.sampled_logprobs is not None]
    if sampled:
        out["sampled"] = torch.from_numpy(np.stack(sampled))
    counts = [r.sample_counts for r in rows if r.sample_counts is not None]
    if counts:
        out["counts"] = torch.from_numpy(np.stack(counts).astype(np.int64))
    return out


def _topk_loss(
    head: LMHeadInputs, inputs: dict[str, torch.Tensor], x: torch.Tensor, *, mode: LossMode
) -> torch.Tensor:
    """The fused top-k forward KL in ``mode`` (``tail_actual``: with the next token)."""
    actual = mode == "tail_actual"
    teacher = TeacherTargets(
        inputs["ids"],
        inputs["logprobs"],
        sampled_ids=torch.roll(x, -1, dims=-1) if actual else None,
        sampled_logprobs=inputs["sampled"] if actual else None,
    )
    head_pair = (head.weight, head.bias)
    loss, _ = lm_head_topk_kl_loss(head_pair, head.hidden, teacher, LossOptions(mode=mode))
    return loss


def topk_kind(top_k: int, mode: LossMode = "tail", dtype: str = "float16") -> PayloadKind:
    """Today's payload at ``top_k``: what ``score(tokens, top_k=K)`` sends (int32 ids,
    ``dtype`` log-probs, the next token's log-prob), trained with the top-k loss in
    ``mode``."""
    options = RequestOptions(top_k=top_k, dtype=dtype)
    suffix = "" if dtype == "float16" else f"-{dtype}"
    return PayloadKind(
        name=f"top{top_k}-{mode}{suffix}",
        label=f"top-{top_k} ids (int32) + {dtype} log-probs + next token's; {mode} loss",
        record=partial(_record_topk, options=options),
        read=_read_topk,
        loss=partial(_topk_loss, mode=mode),
    )


def packed_kind(
    top_k: int, logprob_bits: int = DEFAULT_LOGPROB_BITS, mode: LossMode = "tail"
) -> PayloadKind:
    """The packed payload at ``top_k``: what ``score(tokens, top_k=K, encoding="packed",
    logprob_bits=b)`` sends (ids at ``ceil(log2 V)`` bits, log-probs as ``b``-bit codes on
    each row's grid, float16 ends, the next token's log-prob), trained with the top-k loss
    in ``mode`` on the decoded (quantized) values."""
    options = RequestOptions(top_k=top_k, encoding="packed", logprob_bits=logprob_bits)
    return PayloadKind(
        name=f"top{top_k}-packed",
        label=f"top-{top_k} packed: ids at ceil(log2 V) bits + {logprob_bits}-bit log-probs "
        f"+ next token's; {mode} loss",
        record=partial(_record_topk, options=options),
        read=_read_topk,
        loss=partial(_topk_loss, mode=mode),
    )


# -- the sampled kinds ------------------------------------------------------------------------


def _record_sampled(
    log_p: torch.Tensor, x: torch.Tensor, generator: torch.Generator, *, options: RequestOptions
) -> Recorded:
    """The sampled messages of a batch, as a teacher draws them (``sample_rows`` with the
    request's seed, each window's sequence key, positions ``0..T-1``), one
    ``SequencePayload`` per window. The seed is ``generator``'s, so every sampled kind
    draws from the same seed at the same step."""
    sampled = topk_payload(log_p, x, 1)["sampled"]  # the next token's log-prob [B, T]
    positions = torch.arange(x.shape[1])
    seed = generator.initial_seed()
    messages = []
    for b in range(x.shape[0]):
        rows = sample_rows(
            log_p[b], options.samples, seed, sequence_sample_key(x[b].numpy()), positions,
            options.proposal_temperature,
        )  # fmt: skip
        arrays = SequenceArrays(
            rows.ids.numpy().astype(np.int32),
            rows.logprobs.numpy(),
            sampled[b].numpy() if options.include_sampled else None,
            sample_counts=rows.counts.numpy().astype(np.uint8),
        )
        messages.append(encode_sequence(arrays, dtype=options.dtype, sequence_index=b))
    return Recorded(messages, sum(m.ByteSize() for m in messages))


def _sampled_loss(
    head: LMHeadInputs, inputs: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """The fused sampled loss: cross-entropy against the empirical target ``c_i / N``
    (the teacher's log-probs give the loss its KL offset; the gradient does not use
    them)."""
    teacher = TeacherTargets(inputs["ids"], inputs["logprobs"], sample_counts=inputs["counts"])
    loss, _ = lm_head_topk_kl_loss((head.weight, head.bias), head.hidden, teacher)
    return loss


def sampled_kind(samples: int, seed: int = 0) -> PayloadKind:
    """The sampled payload of ``samples`` draws per position: what ``score(tokens,
    samples=N, seed=S)`` sends (each row's distinct ids as int32, padded to N columns,
    float16 log-probs at them, uint8 counts, the next token's log-prob), trained with the
    sampled loss. ``seed`` is only the request's placeholder: the draws use the step's
    seed."""
    options = RequestOptions(top_k=samples, samples=samples, seed=seed)
    return PayloadKind(
        name=f"sampled{samples}",
        label=f"{samples} draws: distinct ids (int32) + counts (uint8) + float16 log-probs, "
        "padded to N, + next token's; sampled loss",
        record=partial(_record_sampled, options=options),
        read=_read_topk,
        loss=_sampled_loss,
    )


#: The kinds that run, by name; the default ``--kinds`` is all of them, in this order.
#: top6 is the top-k nearest 40 bytes per position (6 x 6 + 2 = 38 array bytes), sampled5
#: the sampled payload nearest it (5 x 7 + 2 = 37); sampled7 (51) sits at top8's 50, and
#: top16-packed (46 at V = 8192, 56 at V = 151,936) is the packed top-k under 0.15x of
#: top64's bytes.
KINDS: dict[str, PayloadKind] = {
    k.name: k
    for k in (
        topk_kind(64),
        packed_kind(64),
        topk_kind(16),
        packed_kind(16),
        topk_kind(8),
        topk_kind(6),
        topk_kind(6, "tail_actual"),
        sampled_kind(50),
        sampled_kind(16),
        sampled_kind(7),
        sampled_kind(5),
    )
}

# -- running one kind --------------------------------------------------------------------------


@dataclass
class KindResult:
    """One kind's row: held-out metrics (nats per token) and measured costs."""

    name: str
    label: str
    after: EvalResult
    bytes_per_position: float
    packed_ids_per_position: float
    #: Teacher forward + record, per position, at the benchmark's vocabulary.
    record_us_per_position: float
    train_seconds: float
    #: ``record`` alone per position on dense log-probs of :data:`SCALE_VOCAB` ids.
    scale_record_us_per_position: float = math.nan


@dataclass
class _Costs:
    steps: int = 0
    positions: int = 0
    payload_bytes: int = 0
    packed_ids: int = 0
    forward_s: float = 0.0
    record_s: float = 0.0


def run_kind(
    kind: PayloadKind,
    teacher: Any,
    batches: list[torch.Tensor],
    heldout: torch.Tensor,
    cfg: DistillConfig,
) -> KindResult:
    """Train a fresh student on ``batches`` with ``kind``'s payload and loss; its row.
    Step ``i``'s ``record`` draws from a generator seeded ``cfg.seed + i`` (the same for
    every kind)."""
    costs = _Costs()

    def step_loss(student: Any, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        log_p = teacher_log_probs(teacher, x)
        t1 = time.perf_counter()
        recorded = kind.record(log_p, x, torch.Generator().manual_seed(cfg.seed + costs.steps))
        costs.record_s += time.perf_counter() - t1
        costs.forward_s += t1 - t0
        costs.steps += 1
        costs.positions += x.numel()
        costs.payload_bytes += recorded.payload_bytes
        costs.packed_ids += recorded.packed_ids
        inputs = kind.read(recorded)
        head = causal_lm_hidden_and_head(student, input_ids=x)
        return kind.loss(head, inputs, x)

    after, seconds = train_student(teacher, batches, heldout, cfg, step_loss)
    n = costs.positions
    return KindResult(
        name=kind.name,
        label=kind.label,
        after=after,
        bytes_per_position=costs.payload_bytes / n,
        packed_ids_per_position=costs.packed_ids / n,
        record_us_per_position=1e6 * (costs.forward_s + costs.record_s) / n,
        train_seconds=seconds,
    )


def scale_record_us(
    kind: PayloadKind, *, positions: int = 256, seq_len: int = 128, repeats: int = 3, seed: int = 0
) -> float:
    """Microseconds per position of ``kind.record`` on dense log-probs of
    :data:`SCALE_VOCAB` ids (``positions`` of them, windows of ``seq_len``; the fastest of
    ``repeats``). The values are a peaked synthetic distribution (log-softmax of
    4 x standard normal logits): what costs time here is the vocabulary's size."""
    gen = torch.Generator().manual_seed(seed)
    b = max(1, positions // seq_len)
    log_p = torch.log_softmax(4 * torch.randn(b, seq_len, SCALE_VOCAB, generator=gen), dim=-1)
    x = torch.randint(0, SCALE_VOCAB, (b, seq_len), generator=gen)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        kind.record(log_p, x, torch.Generator().manual_seed(seed))
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / (b * seq_len)


def projected_bytes(result: KindResult, vocab_size: int, scale_vocab: int = SCALE_VOCAB) -> float:
    """Bytes per position at ``scale_vocab`` ids: measured at ``vocab_size``, plus the
    packed ids' extra bits, ``packed_ids_per_position x (ceil(log2 scale_vocab) -
    ceil(log2 vocab_size)) / 8``."""
    extra_bits = math.ceil(math.log2(scale_vocab)) - math.ceil(math.log2(vocab_size))
    return result.bytes_per_position + result.packed_ids_per_position * extra_bits / 8


# -- the table ---------------------------------------------------------------------------------


def format_tables(
    results: list[KindResult],
    before: EvalResult,
    steps: int,
    cfg: DistillConfig,
    vocab_size: int,
    teacher_metrics: dict[str, Any],
) -> str:
    """The quality table and the scale table (markdown)."""
    base = next((r for r in results if r.name == "top64-tail"), results[0])
    best = min(results, key=lambda r: r.after.kl_teacher_student)
    tm = teacher_metrics
    lines = [
        f"Teacher: vocabulary {vocab_size} (BPE), held-out CE {tm.get('heldout_ce', math.nan):.3f}"
        f" nats/token (unigram baseline {tm.get('heldout_unigram_ce', math.nan):.3f}). "
        f"{steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, seed {cfg.seed}; held-out "
        f"{cfg.eval_windows} windows x {cfg.seq_len} tokens, nats per token (lower is "
        f"better). Untrained student: KL(t||s) {before.kl_teacher_student:.3f}, KL(s||t) "
        f"{before.kl_student_teacher:.3f}, CE {before.student_ce:.3f}; teacher CE "
        f"{before.teacher_ce:.3f}.",
        "",
        "| payload | sent, loss | bytes / position | vs top-64 | KL(teacher \\|\\| student) "
        "| KL(student \\|\\| teacher) | student CE | record us / position | train s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        a = r.after
        kl = f"{a.kl_teacher_student:.4f}"
        lines.append(
            f"| {r.name} | {r.label} | {r.bytes_per_position:.1f} "
            f"| {r.bytes_per_position / base.bytes_per_position:.3f}x "
            f"| {f'**{kl}**' if r is best else kl} | {a.kl_student_teacher:.4f} "
            f"| {a.student_ce:.4f} | {r.record_us_per_position:.1f} | {r.train_seconds:.0f} |"
        )
    tb = SCALE_POSITIONS / 1e12
    lines += [
        "",
        f"Scale: {SCALE_POSITIONS:.0e} positions at V = {SCALE_VOCAB:,} (bytes projected "
        f"from the measured bytes per position; record time measured at V = {SCALE_VOCAB:,}, "
        "the teacher's forward not included).",
        "",
        f"| payload | bytes / position | TB | record us / position | hours ({cfg.threads} "
        "threads) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        b = projected_bytes(r, vocab_size)
        us = r.scale_record_us_per_position
        hours = SCALE_POSITIONS * us * 1e-6 / 3600
        lines.append(f"| {r.name} | {b:.1f} | {b * tb:.3f} | {us:.2f} | {hours:,.0f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality_payloads")
    ap.add_argument("--teacher-dir", type=Path, default=BPE_CACHE_DIR)
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=list(KINDS),
        help=f"payload kinds, in table order (default: all of {list(KINDS)})",
    )
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument(
        "--scale-positions",
        type=int,
        default=256,
        help="positions of dense V = 151,936 log-probs the scale row times record on "
        "(0: skip the scale timing)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/quality_payloads"))
    return ap


def _kinds(names: list[str]) -> list[PayloadKind]:
    for name in names:
        if name not in KINDS:
            raise SystemExit(f"--kinds: unknown kind {name!r}; choose from {list(KINDS)}")
    return [KINDS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = _kinds(args.kinds)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    teacher_dir = build_default_teacher(args.teacher_dir, config=bpe_teacher_config())
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    vocab = int(teacher.config.vocab_size)
    corpus = teacher_corpus(teacher_dir)
    heldout = fixed_windows(corpus.heldout, length=args.seq_len, count=args.eval_windows)
    sampler = WindowSampler(
        corpus.train, batch_size=args.batch_size, length=args.seq_len, seed=args.seed
    )
    batches = [sampler.sample() for _ in range(args.steps)]  # the same for every kind
    cfg = DistillConfig(
        batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        eval_windows=args.eval_windows, threads=args.threads,
    )  # fmt: skip
    before = evaluate(student_model(vocab, cfg), teacher, heldout)
    results: list[KindResult] = []
    for kind in kinds:
        r = run_kind(kind, teacher, batches, heldout, cfg)
        if args.scale_positions > 0:
            r.scale_record_us_per_position = scale_record_us(
                kind,
                positions=args.scale_positions,
                seq_len=min(args.seq_len, args.scale_positions),
            )
        results.append(r)
        print(f"{kind.name}: {r.bytes_per_position:.1f} B/position, {r.after}", flush=True)
    teacher_metrics = (read_marker(teacher_dir) or {}).get("metrics", {})
    table = format_tables(results, before, args.steps, cfg, vocab, teacher_metrics)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "teacher_dir": str(teacher_dir),
        "teacher": teacher_metrics,
        "vocab_size": vocab,
        "config": {**asdict(cfg), "steps": args.steps},
        "before": asdict(before),
        "rows": [
            {**asdict(r), "scale_bytes_per_position": projected_bytes(r, vocab)} for r in results
        ],
    }
    (args.out / "quality_payloads.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "quality_payloads.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
