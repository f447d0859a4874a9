"""Multi-teacher distillation (MOPD): two domain teachers, one student, rows routed by domain.

Two tiny byte-level teachers are pretrained on clearly different corpora
(:mod:`examples.data`): the Python standard library's ``.py`` sources (``code``) and the
documentation installed packages ship (``docs``: package descriptions, ``.txt`` /
``.rst`` / ``.md`` / ``.html``). Both are served (``teacher-server serve``, one process
per teacher) and reached through one
:class:`~student_client.clients.multi_teacher.MultiTeacherClient`.
Every training batch holds half code windows and half docs windows, the same batches for
every student:

- ``routed``: each window is scored by its own domain's teacher (``teacher=[...]``);
- ``code only`` / ``docs only``: the same student, the same windows and steps, every
  window scored by that one teacher (the single-teacher baselines, same total budget);
- ``code half`` / ``docs half``: the same student and steps, trained only on the half of
  each batch that is its domain, scored by that domain's teacher: exactly the routed
  student's signal about that teacher, and nothing else (so the routed student against
  it measures what sharing one student with the other teacher costs).

Afterwards, on held-out files of each domain, it reports the full-vocabulary
KL(domain's teacher || student) (the teachers' weights are read locally for that), and
how far the routed student is from the matching single-teacher student on each domain
(with ``--eval-every N`` also every ``N`` steps, to see how that gap moves with training).
For reference it reports the KL of each domain's teacher to the 50/50 mixture of the two
teachers: the best a student reaches if it does not tell the domains apart.

    python -m examples.mopd [--steps 1200] [--backend vllm|transformers] [--out runs/mopd]

The teachers are built once and cached under ``--cache-dir`` (``.cache/topk-distill``;
about 5 minutes each on two CPU cores at the default budget).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from examples.data import ByteCorpus, WindowSampler, fixed_windows, load_docs_corpus
from examples.data import load_stdlib_corpus as load_code_corpus
from examples.distill import DistillConfig, EvalResult, distill_loss, evaluate, student_model
from examples.teacher_pretrain import PretrainConfig, build_default_teacher

__all__ = ["DOMAINS", "MopdConfig", "main", "run_mopd", "train_student"]

log = logging.getLogger(__name__)

#: The domains, in batch order: the first half of every batch is ``code``.
DOMAINS = ("code", "docs")
#: Students trained in one run: the routed one, one per teacher alone on every window,
#: and one per teacher on only its own domain's half of every batch.
STUDENTS = ("routed", "code only", "docs only", "code half", "docs half")


@dataclass(frozen=True)
class MopdConfig:
    """Everything that decides a run (the teachers' budget included)."""

    # The defaults are the full run of docs/multi_teacher.md ("The example").
    steps: int = 1200
    batch_size: int = 8  # half code, half docs
    seq_len: int = 128
    top_k: int = 16
    depth: int = 4
    lr: float = 3e-3
    seed: int = 0
    eval_windows: int = 16
    #: Held-out KL of every student every this many steps as well (0: at the end only).
    eval_every: int = 150
    #: The student (the same for all five): width and depth of the fresh Qwen2.
    hidden_size: int = 64
    num_layers: int = 1
    #: The teachers' pretraining budget (each: steps x windows x bytes). 3000 steps give
    #: teachers of 1.4 / 1.8 nats per byte; 200-step teachers (2.5 / 2.8) are so simple
    #: that the single-teacher students copy them far better than a routed one can.
    teacher_steps: int = 3000
    teacher_batch_size: int = 16
    teacher_seq_len: int = 128
    threads: int = 2
    #: Read at most this many bytes of each corpus (None: all of it).
    corpus_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 2 or self.batch_size % 2:
            raise ValueError(f"batch_size: must be even and >= 2, got {self.batch_size}")
        for name in (
            "steps", "seq_len", "top_k", "eval_windows", "teacher_steps", "hidden_size",
            "num_layers",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size: must be even (two heads), got {self.hidden_size}")


@dataclass
class MopdResult:
    #: student -> domain -> held-out metrics against that domain's teacher.
    heldout: dict[str, dict[str, EvalResult]] = field(default_factory=dict)
    #: student -> [(step, {domain: held-out KL})] every ``eval_every`` steps.
    curve: dict[str, list[tuple[int, dict[str, float]]]] = field(default_factory=dict)
    #: domain -> KL(domain's teacher || 50/50 mixture of the two teachers), held out.
    mixture_kl: dict[str, float] = field(default_factory=dict)
    train_loss: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    teachers: dict[str, Any] = field(default_factory=dict)


def _corpora(max_bytes: int | None = None) -> dict[str, ByteCorpus]:
    return {
        "code": load_code_corpus(max_bytes=max_bytes),
        "docs": load_docs_corpus(max_bytes=max_bytes),
    }


def build_teachers(
    cache_dir: Path, cfg: MopdConfig, corpora: dict[str, ByteCorpus]
) -> dict[str, Path]:
    """Each domain's teacher, pretrained with :mod:`examples.teacher_pretrain` for
    ``cfg.teacher_steps`` steps (cached: a finished directory is reused)."""
    out = {}
    for domain in DOMAINS:
        pre = PretrainConfig(
            train_seconds=0,
            max_steps=cfg.teacher_steps,
            batch_size=cfg.teacher_batch_size,
            seq_len=cfg.teacher_seq_len,
            warmup_steps=min(50, max(1, cfg.teacher_steps // 10)),
            eval_windows=cfg.eval_windows,
            threads=cfg.threads,
        )
        name = f"mopd-{domain}-{cfg.teacher_steps}x{cfg.teacher_batch_size}x{cfg.teacher_seq_len}"
        if cfg.corpus_max_bytes is not None:
            name += f"-{cfg.corpus_max_bytes}b"
        out[domain] = build_default_teacher(cache_dir / name, config=pre, corpus=corpora[domain])
    return out


def mixed_batches(corpora: dict[str, ByteCorpus], cfg: MopdConfig) -> list[torch.Tensor]:
    """``cfg.steps`` batches ``[B, T]``: rows ``[0, B/2)`` code windows, ``[B/2, B)`` docs."""
    half = cfg.batch_size // 2
    samplers = [
        WindowSampler(corpora[d].train, batch_size=half, length=cfg.seq_len, seed=cfg.seed + i)
        for i, d in enumerate(DOMAINS)
    ]
    return [torch.cat([s.sample() for s in samplers]) for _ in range(cfg.steps)]


def rows(student: str, batch_size: int) -> slice:
    """The rows of every batch ``student`` trains on: all of them, or (``"<domain> half"``)
    that domain's half."""
    if not student.endswith(" half"):
        return slice(0, batch_size)
    half = batch_size // 2
    i = DOMAINS.index(student.split()[0])
    return slice(i * half, (i + 1) * half)


def routing(student: str, batch_size: int) -> list[str]:
    """The teacher of each row ``student`` trains on (:func:`rows`) of a batch."""
    if student == "routed":
        half = batch_size // 2
        return [DOMAINS[0]] * half + [DOMAINS[1]] * half
    r = rows(student, batch_size)
    return [student.split()[0]] * (r.stop - r.start)


def train_student(
    client: Any,
    student: str,
    batches: list[torch.Tensor],
    vocab: int,
    cfg: MopdConfig,
    checkpoint: Callable[[int, Any], None] | None = None,
) -> tuple[Any, list[float], float]:
    """A fresh student distilled on the :func:`rows` of ``batches``, each row scored by
    the teacher :func:`routing` gives it; returns ``(model, losses, seconds)``. ``checkpoint(step,
    model)`` is called every ``cfg.eval_every`` steps (its time is not counted)."""
    from student_client.data.batch import ScoreBatch

    dcfg = DistillConfig(
        seq_len=cfg.seq_len,
        top_k=cfg.top_k,
        seed=cfg.seed,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
    )
    model = student_model(vocab, dcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1
    )
    teachers = routing(student, cfg.batch_size)
    batches = [x[rows(student, cfg.batch_size)] for x in batches]
    items = [ScoreBatch(x, teacher=teachers) for x in batches]
    losses = []
    paused = 0.0
    t0 = time.perf_counter()
    payloads = client.stream(items, cfg.top_k, depth=cfg.depth, include_sampled=False)
    for step, (x, payload) in enumerate(zip(batches, payloads, strict=True), start=1):
        assert payload.teachers == tuple(teachers)
        loss, _stats = distill_loss(model, x, payload, dcfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if checkpoint is not None and cfg.eval_every and step % cfg.eval_every == 0:
            t1 = time.perf_counter()
            checkpoint(step, model)
            paused += time.perf_counter() - t1
    return model, losses, time.perf_counter() - t0 - paused


@torch.inference_mode()
def mixture_kl(teachers: dict[str, Any], domain: str, windows: torch.Tensor) -> float:
    """KL(``domain``'s teacher || the 50/50 mixture of all ``teachers``) on ``windows``
    ``[N, T]``, nats per position: the best a student reaches if its prediction does not
    depend on which domain the window is from (the equal mixture minimises the summed
    forward KL to the teachers)."""
    logp = {
        d: torch.log_softmax(m(input_ids=windows).logits.float(), -1) for d, m in teachers.items()
    }
    mix = torch.logsumexp(torch.stack(list(logp.values())), 0) - math.log(len(logp))  # [N, T, V]
    own = logp[domain]
    return float((own.exp() * (own - mix)).sum(-1).mean())


def run_mopd(targets: dict[str, str], teacher_dirs: dict[str, Path], cfg: MopdConfig) -> MopdResult:
    """Train the three students through one multi-teacher client and evaluate them on
    every domain against that domain's teacher."""
    from transformers import AutoModelForCausalLM

    from student_client.clients.multi_teacher import MultiTeacherClient

    torch.set_num_threads(cfg.threads)
    corpora = _corpora(cfg.corpus_max_bytes)
    local = {
        d: AutoModelForCausalLM.from_pretrained(teacher_dirs[d], dtype=torch.float32).eval()
        for d in DOMAINS
    }
    vocab = int(local["code"].config.vocab_size)
    heldout = {
        d: fixed_windows(corpora[d].heldout, length=cfg.seq_len, count=cfg.eval_windows)
        for d in DOMAINS
    }
    batches = mixed_batches(corpora, cfg)
    result = MopdResult(mixture_kl={d: mixture_kl(local, d, heldout[d]) for d in DOMAINS})
    with MultiTeacherClient(targets, expect_vocab_size=vocab) as client:
        result.teachers = {
            name: {"model": info.model_name, "backend": info.backend}
            for name, info in client.connect().items()
        }
        for student in STUDENTS:
            curve = result.curve[student] = []

            def checkpoint(step: int, model: Any, curve: list[Any] = curve) -> None:
                kl = {d: evaluate(model, local[d], heldout[d]).kl_teacher_student for d in DOMAINS}
                curve.append((step, kl))

            model, losses, seconds = train_student(client, student, batches, vocab, cfg, checkpoint)
            result.train_loss[student] = losses
            result.seconds[student] = round(seconds, 1)
            result.heldout[student] = {d: evaluate(model, local[d], heldout[d]) for d in DOMAINS}
            print(f"{student}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return result


def gaps(result: MopdResult, baseline: str = "only") -> dict[str, float]:
    """Per domain: routed KL / the matching single-teacher student's KL - 1 (negative:
    routed lower); ``baseline`` ``"only"`` (every window) or ``"half"`` (its own half)."""
    out = {}
    for d in DOMAINS:
        routed = result.heldout["routed"][d].kl_teacher_student
        alone = result.heldout[f"{d} {baseline}"][d].kl_teacher_student
        out[d] = routed / alone - 1.0
    return out


def curve_gaps(result: MopdResult, baseline: str = "only") -> list[tuple[int, dict[str, float]]]:
    """:func:`gaps` at every checkpoint: ``[(step, {domain: gap})]``."""
    out = []
    for i, (step, routed) in enumerate(result.curve.get("routed", [])):
        alone = {d: result.curve[f"{d} {baseline}"][i][1][d] for d in DOMAINS}
        out.append((step, {d: routed[d] / alone[d] - 1.0 for d in DOMAINS}))
    return out


def format_table(result: MopdResult, cfg: MopdConfig) -> str:
    """Per-domain held-out KL of every student (markdown) and the routed student's gap."""
    lines = [
        f"held-out: {cfg.eval_windows} windows x {cfg.seq_len} bytes per domain, of files no "
        "model trained on; full-vocabulary KL(domain's teacher || student), nats per byte",
        "",
        "| student | " + " | ".join(f"{d} KL" for d in DOMAINS) + " | mean |",
        "|---|" + "---:|" * (len(DOMAINS) + 1),
    ]
    for s in STUDENTS:
        kls = [result.heldout[s][d].kl_teacher_student for d in DOMAINS]
        lines.append(f"| {s} | " + " | ".join(f"{v:.3f}" for v in kls) + f" | {sum(kls) / 2:.3f} |")
    ce = [result.heldout["routed"][d].teacher_ce for d in DOMAINS]
    mix = [result.mixture_kl[d] for d in DOMAINS]
    lines.append(
        "| (50/50 mixture of the teachers) | "
        + " | ".join(f"{v:.3f}" for v in mix)
        + f" | {sum(mix) / 2:.3f} |"
    )
    lines.append("| (domain teacher's own CE) | " + " | ".join(f"{v:.3f}" for v in ce) + " | |")
    for baseline, what in (("only", "every window"), ("half", "its own half of each batch")):
        g = gaps(result, baseline)
        lines += [
            "",
            f"routed vs the matching single-teacher student on {what} (<domain> {baseline}): "
            + ", ".join(f"{d} {100 * g[d]:+.1f}%" for d in DOMAINS),
        ]
        curve = zip(curve_gaps(result, baseline), result.curve["routed"], strict=True)
        for (step, cg), (_, routed) in curve:
            lines.append(
                f"  at step {step}: "
                + ", ".join(f"{d} {100 * cg[d]:+.1f}% (routed {routed[d]:.3f})" for d in DOMAINS)
            )
    lines.append(
        f"{cfg.steps} steps x {cfg.batch_size} windows ({cfg.batch_size // 2} per domain) x "
        f"{cfg.seq_len} bytes per student ({cfg.hidden_size} wide, {cfg.num_layers} "
        f"layer(s)), top-{cfg.top_k} tail-aware KL; teachers: "
        f"{cfg.teacher_steps} pretraining steps each; "
        + ", ".join(f"{s} {result.seconds[s]:.0f} s" for s in STUDENTS)
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m examples.mopd", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--cache-dir", type=Path, default=Path(".cache/topk-distill"))
    ap.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    ap.add_argument("--out", type=Path, default=Path("runs/mopd"))
    d = MopdConfig()
    for name in (
        "steps", "batch_size", "seq_len", "top_k", "depth", "seed", "eval_windows",
        "eval_every", "hidden_size", "num_layers", "teacher_steps", "teacher_batch_size",
        "teacher_seq_len",
    ):  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument(
        "--corpus-max-bytes", type=int, help="read at most this many bytes of each corpus"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = [f for f in MopdConfig.__dataclass_fields__ if hasattr(args, f)]
    try:
        cfg = MopdConfig(**{n: getattr(args, n) for n in names})
    except ValueError as e:
        raise SystemExit(f"examples.mopd: {e}") from None
    from examples.demo import serve_teacher

    teacher_dirs = build_teachers(args.cache_dir, cfg, _corpora(cfg.corpus_max_bytes))
    args.out.mkdir(parents=True, exist_ok=True)
    # Both teachers start at once (each waits for its /readyz).
    with ThreadPoolExecutor(len(DOMAINS)) as pool:
        starting = [
            pool.submit(serve_teacher, teacher_dirs[d], args.backend, args.out / f"teacher-{d}.log")
            for d in DOMAINS
        ]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        for f in starting:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        targets = {d: s.target for d, s in zip(DOMAINS, servers, strict=True)}
        result = run_mopd(targets, teacher_dirs, cfg)
    finally:
        for s in servers:
            s.stop(timeout_s=120)
    print(format_table(result, cfg))
    (args.out / "result.json").write_text(
        json.dumps(
            {
                "config": asdict(cfg),
                "result": asdict(result),
                "gaps": gaps(result),
                "curve_gaps": curve_gaps(result),
                "gaps_half": gaps(result, "half"),
                "curve_gaps_half": curve_gaps(result, "half"),
            },
            indent=2,
        )
        + "\n"
    )
    finite = all(
        math.isfinite(r.kl_teacher_student) for s in result.heldout.values() for r in s.values()
    )
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
