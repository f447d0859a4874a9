"""Does cross-tokenizer distillation through the teacher work? Held-out nats per byte of
students of another tokenizer than their teacher's, trained by six signals on the same
text, steps and seeds.

Two pairs, both from the repository's own teachers (`examples/teacher_pretrain.py`, built
once and cached) and one student tokenizer, a byte-level BPE of ``--student-vocab``
(4,096) ids learned from every other training file of the same corpus (other merges than
the teacher's BPE, most token ends shared):

- **bpe8k -> bpe4k**: the BPE teacher (8,192 ids) into the 4,096-id student;
- **byte -> bpe4k**: the byte-level teacher into the same student.

Arms (:data:`benchmarks.cross_tokenizer_arms.ARMS`), each a fresh student of the same
architecture (`examples.cross_tokenizer.student_model`) on the same windows of the
training files, AdamW, ``--steps`` steps. Every arm with a served teacher signal trains
on ``CE_WEIGHT * cross-entropy + (1 - CE_WEIGHT) * its teacher term`` (the usual recipe:
a top-k teacher says nothing about which tail token came next, the text does):

- (a) a student of the teacher's own tokenizer, served top-k + tail: the upper bound;
- (b) cross-entropy on the text alone: the floor;
- (c) the teacher's chain-rule log-prob of the actual next token as the only teacher
  signal (what networked peers send), as a two-outcome KL (`actual_token_kl`);
- (d) this project's served, aligned top-k with the tail-aware loss (`topk_kl_loss`;
  the rows the teacher masks get the cross-entropy only);
- (e) TRL's GOLD loss as TRL ships it (`ULDLoss` at `GOLDConfig`'s defaults: extended
  ULD with span merging, no cross-entropy; plus the hybrid matched / unmatched loss,
  :data:`GOLD_SETTINGS`), TRL's own input builder, the teacher in this process;
- (f) (d)'s teacher term alone, without the cross-entropy.

The served arms read one `teacher-server serve --student-tokenizer` per pair (its
``--backend``, transformers by default), ``--top-k`` 64; a step's payload is fetched once
and serves arms c, d and f. The metric: held-out nats per byte (the summed next-token
``-log q`` over the bytes predicted) on windows of the held-out files, which neither
model trained on, every ``--eval-every`` steps; the mean and range over ``--seeds``.
Also the share of masked rows per pair and the teacher seconds per run (arm e: its
in-process forwards; c, d, f: the same fetches).

    python -m benchmarks.quality_cross_tokenizer [--steps 150] [--seeds 0 1 2]
        [--out runs/quality_cross_tokenizer] [--plot docs/quality_cross_tokenizer.png]

Each run's result is kept in ``--out/runs/`` with its configuration; a re-run with the
same configuration reads it instead of training again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cross_tokenizer_arms import (
    ARMS,
    actual_token_kl,
    cross_entropy,
    masked_rows,
    nats_per_byte,
    topk_tail_kl,
)
from benchmarks.seed_cells import mean_and_range
from examples.cross_tokenizer import student_model, text_windows
from examples.data import load_stdlib_corpus, split_documents
from student_client.data.payload import TeacherPayload
from student_client.losses.types import LossMode

__all__ = ["BenchConfig", "RunResult", "format_table", "main", "verdicts"]

#: The student tokenizer's name on the teacher.
STUDENT = "student"
#: The weight of the text's cross-entropy in every arm with a teacher signal (but "f"):
#: ``CE_WEIGHT * CE + (1 - CE_WEIGHT) * teacher term``.
CE_WEIGHT = 0.5
#: What arm "e" changes of TRL's `GOLDConfig` defaults (ULD on, extended ULD with span
#: merging and the "observed" merge as defaulted; the cross-entropy weight left at 0).
GOLD_SETTINGS: dict[str, Any] = {"use_uld_loss": True, "uld_use_hybrid_loss": True}


@dataclass(frozen=True)
class BenchConfig:
    """Everything that decides a run besides its pair, arm and seed. Windows (training and
    held-out) stay within the positions the teachers were trained on (the byte teacher:
    256), where a RoPE model is what it learned to be."""

    steps: int = 150
    batch_size: int = 8
    window_bytes: int = 256
    eval_texts: int = 128
    eval_bytes: int = 256
    eval_every: int = 10
    top_k: int = 64
    mode: LossMode = "tail"
    lr: float = 3e-3
    student_vocab: int = 4096
    backend: str = "transformers"


@dataclass
class RunResult:
    """One (pair, arm, seed): held-out nats per byte at ``steps`` (0 first), and seconds."""

    pair: str
    arm: str
    seed: int
    steps: list[int]
    heldout: list[float]
    teacher_s: float
    train_s: float
    masked_share: float = float("nan")


@dataclass
class StepSignals:
    """One training step's texts in both tokenizers and the teacher's answers to them."""

    texts: list[str]
    student: dict[str, torch.Tensor]
    own: dict[str, torch.Tensor]
    cross: TeacherPayload
    same: TeacherPayload


@dataclass
class SeedSignals:
    """The steps of one (pair, seed) and what fetching them cost."""

    steps: list[StepSignals] = field(default_factory=list)
    cross_s: float = 0.0
    same_s: float = 0.0

    def masked_share(self) -> float:
        masked = sum(int(masked_rows(s.cross).sum()) for s in self.steps)
        rows = sum(int(s.cross.mask.sum()) for s in self.steps)
        return masked / rows if rows else float("nan")


@dataclass
class Pair:
    """A teacher, its tokenizer, the student tokenizer, and what a run reads of them."""

    name: str
    teacher_dir: Path
    student_dir: Path
    teacher_tok: Any
    student_tok: Any

    @property
    def slug(self) -> str:
        """The name in file names."""
        return self.name.replace(" -> ", "-to-")


def _encode(tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def fetch_signals(pair: Pair, target: str, cfg: BenchConfig, seed: int, corpus: Any) -> SeedSignals:
    """Every step's texts (``seed``'s windows of the training files) scored by the teacher
    at ``target`` twice: in the student's ids and in its own."""
    from student_client import TeacherClient

    rng = np.random.default_rng(seed)
    out = SeedSignals()
    with (
        TeacherClient(
            target, student_tokenizer=STUDENT, expect_vocab_size=len(pair.student_tok)
        ) as cross_client,
        TeacherClient(target) as same_client,
    ):
        for _ in range(cfg.steps):
            texts = text_windows(corpus.train, cfg.batch_size, cfg.window_bytes, rng)
            student, own = _encode(pair.student_tok, texts), _encode(pair.teacher_tok, texts)
            t0 = time.perf_counter()
            cross = cross_client.score(student, cfg.top_k, dtype="float32")
            t1 = time.perf_counter()
            same = same_client.score(own, cfg.top_k, dtype="float32")
            out.cross_s += t1 - t0
            out.same_s += time.perf_counter() - t1
            out.steps.append(StepSignals(texts, student, own, cross, same))
    return out


class GoldLoss:
    """TRL's GOLD loss with the teacher in this process: TRL's own input builder for both
    tokenizers (byte offsets of each token), the teacher's forward, `ULDLoss`."""

    def __init__(self, pair: Pair, workdir: Path) -> None:
        from transformers import AutoModelForCausalLM
        from trl.experimental.gold.gold_config import GOLDConfig
        from trl.experimental.gold.gold_trainer import ULDLoss

        config = GOLDConfig(
            output_dir=str(workdir / "gold"),
            **GOLD_SETTINGS,
            use_cpu=True,
            bf16=False,
            report_to=[],
        )
        self.pair = pair
        self.loss_fn = ULDLoss(config, pair.student_tok, pair.teacher_tok)
        self.teacher = AutoModelForCausalLM.from_pretrained(pair.teacher_dir, dtype=torch.float32)
        self.teacher.eval()
        self.teacher_s = 0.0

    def __call__(self, model: Any, texts: list[str]) -> torch.Tensor:
        from trl.experimental.gold.gold_trainer import build_teacher_inputs_from_texts

        prompts = [""] * len(texts)
        s_ids, s_labels, s_mask, s_offsets = build_teacher_inputs_from_texts(
            self.pair.student_tok, prompts, texts
        )
        t_ids, t_labels, t_mask, t_offsets = build_teacher_inputs_from_texts(
            self.pair.teacher_tok, prompts, texts
        )
        t0 = time.perf_counter()
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=t_ids, attention_mask=t_mask).logits
        self.teacher_s += time.perf_counter() - t0
        student_logits = model(input_ids=s_ids, attention_mask=s_mask).logits
        loss: torch.Tensor = self.loss_fn(
            student_logits=student_logits,
            teacher_logits=teacher_logits,
            student_labels=s_labels,
            teacher_labels=t_labels,
            student_input_ids=s_ids,
            teacher_input_ids=t_ids,
            student_byte_offsets=s_offsets,
            teacher_byte_offsets=t_offsets,
        )
        return loss


def _step_loss(
    arm: str, model: Any, step: StepSignals, gold: GoldLoss | None, mode: LossMode
) -> torch.Tensor:
    """The arm's loss on one step: the text's cross-entropy (arm "b" alone), plus the arm's
    teacher term, weighted :data:`CE_WEIGHT` and ``1 - CE_WEIGHT`` (arm "f": the teacher
    term alone). Arm "a" reads the teacher's ids, the others the student's."""
    if arm == "e":
        assert gold is not None
        return gold(model, step.texts)
    batch = step.own if arm == "a" else step.student
    logits = model(**batch).logits
    ids = batch["input_ids"]
    ce = cross_entropy(logits, ids, batch["attention_mask"].bool())
    if arm == "b":
        return ce
    if arm == "a":
        teacher = topk_tail_kl(logits, ids, step.same, mode)
    elif arm == "c":
        assert step.cross.sampled_logprobs is not None
        teacher = actual_token_kl(logits, ids, step.cross.sampled_logprobs)
    elif arm in ("d", "f"):
        teacher = topk_tail_kl(logits, ids, step.cross, mode)
    else:
        raise ValueError(f"arm: one of {sorted(ARMS)}, got {arm!r}")
    return teacher if arm == "f" else CE_WEIGHT * ce + (1 - CE_WEIGHT) * teacher


def train_arm(
    arm: str,
    seed: int,
    signals: SeedSignals,
    vocab_size: int,
    evaluate: Callable[[Any], float],
    cfg: BenchConfig,
    gold: GoldLoss | None = None,
) -> tuple[list[int], list[float], float]:
    """Train one fresh student; its held-out curve (steps, nats per byte) and seconds."""
    model = student_model(vocab_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    steps, curve = [0], [evaluate(model)]
    t0 = time.perf_counter()
    for i, step in enumerate(signals.steps, start=1):
        loss = _step_loss(arm, model, step, gold, cfg.mode)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % cfg.eval_every == 0 or i == len(signals.steps):
            steps.append(i)
            curve.append(evaluate(model))
    return steps, curve, time.perf_counter() - t0


def _teacher_seconds(arm: str, signals: SeedSignals, gold: GoldLoss | None) -> float:
    if arm == "a":
        return signals.same_s
    if arm == "e":
        return gold.teacher_s if gold is not None else 0.0
    return 0.0 if arm == "b" else signals.cross_s


def _by_arm(runs: list[RunResult], pair: str) -> dict[str, list[RunResult]]:
    out: dict[str, list[RunResult]] = {}
    for r in runs:
        if r.pair == pair:
            out.setdefault(r.arm, []).append(r)
    return out


def format_table(
    runs: list[RunResult], pairs: list[str], references: dict[str, float], cfg: BenchConfig
) -> str:
    """One markdown table per pair: held-out nats per byte after the last step (mean and
    range over seeds), its difference from arm (b), seconds per run."""
    lines: list[str] = []
    for pair in pairs:
        arms = _by_arm(runs, pair)
        anyrun = next(iter(arms.values()))
        masked = [r.masked_share for r in arms.get("d", anyrun)]
        untrained = [r.heldout[0] for r in arms.get("b", anyrun)]
        ce = arms.get("b")
        lines += [
            f"**{pair}**: masked rows {100 * float(np.nanmean(masked)):.1f}% of the served "
            f"rows; the teacher {references.get(pair, float('nan')):.4f} nats/byte, an "
            f"untrained student {mean_and_range(untrained, 4)}.",
            "",
            "| arm | signal | held-out nats/byte | vs (b) | teacher s/run | train s/run |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for arm in sorted(arms):
            rs = arms[arm]
            final = [r.heldout[-1] for r in rs]
            delta = (
                ""
                if ce is None
                else f"{np.mean(final) - np.mean([r.heldout[-1] for r in ce]):+.4f}"
            )
            lines.append(
                f"| ({arm}) | {ARMS[arm]} | {mean_and_range(final, 4)} | {delta} "
                f"| {np.mean([r.teacher_s for r in rs]):.1f} "
                f"| {np.mean([r.train_s for r in rs]):.1f} |"
            )
        lines.append("")
    steps = anyrun[0].steps[-1]
    lines.append(
        f"{steps} steps x {cfg.batch_size} windows of {cfg.window_bytes} bytes, top-"
        f"{cfg.top_k}, AdamW lr {cfg.lr:g}, seeds {len(anyrun)}; held-out: "
        f"{cfg.eval_texts} windows x {cfg.eval_bytes} bytes of the held-out files."
    )
    return "\n".join(lines)


def verdicts(runs: list[RunResult], pairs: list[str]) -> list[str]:
    """(d) against (b), (c) and (e), and its gap to (a), per pair: the difference of the
    seed means, and whether it exceeds the seed spread (the larger range of the two)."""
    out = []
    for pair in pairs:
        arms = _by_arm(runs, pair)
        if "d" not in arms:
            continue
        d = [r.heldout[-1] for r in arms["d"]]
        for other in ("b", "c", "e", "f", "a"):
            if other not in arms:
                continue
            o = [r.heldout[-1] for r in arms[other]]
            diff = float(np.mean(d) - np.mean(o))
            spread = max(max(d) - min(d), max(o) - min(o))
            word = "beats" if diff < 0 else "trails"
            clear = "more" if abs(diff) > spread else "less"
            out.append(
                f"{pair}: (d) {word} ({other}) by {abs(diff):.4f} nats/byte, {clear} than "
                f"the seed spread ({spread:.4f})"
            )
    return out


def plot(runs: list[RunResult], pairs: list[str], path: Path) -> None:
    """Held-out nats per byte over steps, one panel per pair, one line per arm (the seed
    mean; the band: the seeds' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4.2), squeeze=False)
    for ax, pair in zip(axes[0], pairs, strict=True):
        for arm, rs in sorted(_by_arm(runs, pair).items()):
            curves = np.array([r.heldout for r in rs])
            ax.plot(rs[0].steps, curves.mean(0), label=f"({arm}) {ARMS[arm].split(':')[0]}")
            ax.fill_between(rs[0].steps, curves.min(0), curves.max(0), alpha=0.2)
        ax.set_title(pair)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out nats per byte")
        ax.set_ylim(top=min(5.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _student_tokenizer(path: Path, vocab: int) -> Any:
    """The student tokenizer at ``path``, learned first (every other training file) when
    it is not there."""
    from transformers import AutoTokenizer

    from devtools.tiny_model import train_bpe_tokenizer

    if not (path / "tokenizer.json").exists():
        corpus = load_stdlib_corpus()
        texts = [d.decode("utf-8", "replace") for d in split_documents(corpus.train)]
        train_bpe_tokenizer(texts[1::2], vocab).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


#: The byte-level teacher's pretraining steps: 10x the demo's, so that the teacher (1.5
#: nats per byte held out) is better than what the student reaches on the text alone
#: (the demo's 300-step teacher, 2.07, is not: nothing could be distilled from it).
BYTE_TEACHER_STEPS = 3000
#: Where that teacher is cached (the demo's own stays at its default).
BYTE_TEACHER_DIR = Path(f".cache/topk-distill/teacher-byte-{BYTE_TEACHER_STEPS}")


def _teachers(names: list[str]) -> Iterator[tuple[str, Path]]:
    """The teachers named (built once and cached), in the order given."""
    from examples.teacher_pretrain import (
        BPE_CACHE_DIR,
        PretrainConfig,
        bpe_teacher_config,
        build_default_teacher,
    )

    for name in names:
        if name == "bpe8k":
            yield name, build_default_teacher(BPE_CACHE_DIR, config=bpe_teacher_config())
        else:
            config = PretrainConfig(train_seconds=0, max_steps=BYTE_TEACHER_STEPS)
            yield name, build_default_teacher(BYTE_TEACHER_DIR, config=config)


def _serve(pair: Pair, cfg: BenchConfig, out: Path) -> Any:
    """``teacher-server serve`` on the pair's teacher, serving its student tokenizer."""
    from devtools.launch import start_teacher

    args = [
        "--backend", cfg.backend, "--model", str(pair.teacher_dir), "--dtype", "float32",
        "--max-top-k", "64", "--max-model-len", "4096",
        "--student-tokenizer", f"{STUDENT}={pair.student_dir}",
    ]  # fmt: skip
    return start_teacher(args, out / f"teacher-server-{pair.slug}.log")


def _load(path: Path, config: dict[str, Any]) -> RunResult | None:
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    return RunResult(**stored["result"]) if stored.get("config") == config else None


def run_pair(
    pair: Pair, cfg: BenchConfig, seeds: list[int], arms: list[str], out: Path
) -> tuple[list[RunResult], float]:
    """Every (arm, seed) run of one pair (stored ones read back), and the teacher's own
    held-out nats per byte."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from teacher_server.alignment.token_bytes import token_bytes

    corpus = load_stdlib_corpus()
    eval_texts = text_windows(
        corpus.heldout, cfg.eval_texts, cfg.eval_bytes, np.random.default_rng(12345)
    )
    teacher_vocab = AutoConfig.from_pretrained(pair.teacher_dir).vocab_size
    lengths = {
        "student": token_bytes(pair.student_tok).lengths,
        "teacher": token_bytes(pair.teacher_tok, teacher_vocab).lengths,
    }
    held = {
        "student": _ids(pair.student_tok, eval_texts),
        "teacher": _ids(pair.teacher_tok, eval_texts),
    }
    teacher = AutoModelForCausalLM.from_pretrained(pair.teacher_dir, dtype=torch.float32)
    reference = nats_per_byte(teacher, held["teacher"], lengths["teacher"])
    del teacher
    results: list[RunResult] = []
    server: Any = None
    try:
        for seed in seeds:
            todo = []
            for arm in arms:
                path = out / "runs" / f"{pair.slug}-{arm}-seed{seed}.json"
                config = {**asdict(cfg), "pair": pair.name, "arm": arm, "seed": seed}
                if arm == "e":
                    config["gold"] = GOLD_SETTINGS
                stored = _load(path, config)
                if stored is None:
                    todo.append((arm, path, config))
                else:
                    results.append(stored)
            if not todo:
                continue
            if server is None:
                server = _serve(pair, cfg, out)
            print(f"== {pair.name} seed {seed}: fetching", file=sys.stderr, flush=True)
            signals = fetch_signals(pair, server.target, cfg, seed, corpus)
            for arm, path, config in todo:
                side = "teacher" if arm == "a" else "student"
                vocab = teacher_vocab if arm == "a" else len(pair.student_tok)
                gold = GoldLoss(pair, out) if arm == "e" else None

                def evaluate(model: Any, side: str = side) -> float:
                    return nats_per_byte(model, held[side], lengths[side])

                print(f"== {pair.name} ({arm}) seed {seed}", file=sys.stderr, flush=True)
                steps, curve, seconds = train_arm(arm, seed, signals, vocab, evaluate, cfg, gold)
                result = RunResult(
                    pair.name,
                    arm,
                    seed,
                    steps,
                    curve,
                    _teacher_seconds(arm, signals, gold),
                    seconds,
                    signals.masked_share(),
                )
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"config": config, "result": asdict(result)}) + "\n")
                results.append(result)
    finally:
        if server is not None:
            server.stop(timeout_s=120)
    return results, reference


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.quality_cross_tokenizer", description=__doc__.split("\n\n")[0]
    )
    d = BenchConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--mode", choices=["tail", "tail_actual"], default=d.mode)
    ap.add_argument("--backend", choices=["vllm", "transformers"], default=d.backend)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--teachers", nargs="+", choices=["bpe8k", "byte"], default=["bpe8k", "byte"])
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=sorted(ARMS))
    ap.add_argument("--out", type=Path, default=Path("runs/quality_cross_tokenizer"))
    ap.add_argument("--plot", type=Path, default=None, help="the PNG (default: --out/curves.png)")
    args = ap.parse_args(argv)
    cfg = BenchConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        top_k=args.top_k,
        mode=args.mode,
        backend=args.backend,
    )
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    student_dir = args.out / f"student-bpe{cfg.student_vocab // 1024}k"
    student_tok = _student_tokenizer(student_dir, cfg.student_vocab)
    suffix = f"bpe{cfg.student_vocab // 1024}k"
    runs: list[RunResult] = []
    references: dict[str, float] = {}
    names = []
    for name, teacher_dir in _teachers(args.teachers):
        pair = Pair(
            f"{name} -> {suffix}", teacher_dir, student_dir,
            AutoTokenizer.from_pretrained(teacher_dir), student_tok,
        )  # fmt: skip
        results, references[pair.name] = run_pair(pair, cfg, args.seeds, args.arms, args.out)
        runs += results
        names.append(pair.name)
    table = format_table(runs, names, references, cfg)
    lines = verdicts(runs, names)
    (args.out / "table.md").write_text(table + "\n\n" + "\n".join(lines) + "\n")
    plot(runs, names, args.plot or args.out / "curves.png")
    print(table)
    print()
    print("\n".join(lines))
    print(f"\nend to end: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
