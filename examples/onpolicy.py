"""On-policy distillation: the student writes, the teacher grades only what it wrote.

Each step the student (a fresh, smaller Qwen2) continues byte prompts drawn from the
training files (``generate``, sampling at temperature 1): prompts of random length are
left-padded, so the batch is a Hugging Face ``input_ids`` + ``attention_mask`` pair. The
teacher scores only the response positions (a sub-range given as columns of the padded
batch: padding and prompt rows are never sent back), the payload comes back aligned to
the padded batch (:mod:`student_client.data.alignment`), and the tail-aware top-k loss runs on
the response positions only.

The loss is the reverse KL ``KL(student || teacher)`` over the K+1 categories by default
(``--divergence forward|reverse|jsd``). On-policy the positions are the student's own
samples, and the reverse KL is the objective whose per-token estimate on them is the OPD
signal ``log p_teacher(y) - log q_student(y)`` (Thinking Machines' on-policy distillation,
GKD): mode-seeking, it penalises the student for putting mass where the teacher puts
little, which is what its own samples expose, instead of asking a small student to
cover every mode of the teacher (the forward KL's mean-seeking pull). docs/losses.md has
the comparison. Before and after, the held-out metrics of
:mod:`examples.distill` (full-vocabulary KL(teacher || student) on held-out files,
teacher-forced) and the on-policy one of :mod:`examples.onpolicy_eval` (full-vocabulary
KL(student || teacher) over the student's own continuations of held-out prompts, what
this loss optimises) say what the student learned; the payload bytes received are
compared with what full-sequence requests would have carried.

``--group-size G`` samples G continuations of every prompt (the GRPO-style recipe): a
batch holds ``batch_size / G`` prompts, each G times. The G sequences of a prompt share it,
so a teacher with prefix reuse computes the prompt once (docs/vllm.md); the run reports
the teacher's positions computed against positions answered (read from its
``/metrics``: the teacher served here, or ``--teacher-http``).

    python -m examples.onpolicy [--teacher HOST:PORT] [--steps 100] [--group-size 1]
        [--out runs/onpolicy]

Without ``--teacher`` it serves the demo teacher (``--teacher-dir``, built once and
cached like ``make demo`` does) with the vLLM backend for the run's duration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.data import PAD_ID, ByteCorpus, fixed_windows, load_stdlib_corpus
from examples.distill import DistillConfig, EvalResult, heldout_table, student_model
from examples.onpolicy_eval import evaluate_with_onpolicy
from examples.teacher_pretrain import DEFAULT_CACHE_DIR
from student_client.losses import (
    DIVERGENCES,
    LossOptions,
    TeacherTargets,
    get_divergence,
    topk_kl_loss,
)
from student_client.losses.types import SUPPORTS, Support
from topk_protocol import build_request, response_bytes

__all__ = ["OnPolicyConfig", "OnPolicyResult", "main", "run_onpolicy", "sample_prompts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnPolicyConfig:
    """Everything that decides an on-policy run."""

    steps: int = 100
    batch_size: int = 16
    min_prompt: int = 32
    max_prompt: int = 64
    response: int = 64
    top_k: int = 16
    lr: float = 3e-3
    seed: int = 0
    eval_windows: int = 32
    eval_len: int = 256
    #: Held-out prompts (of ``max_prompt`` bytes) the student continues for the on-policy
    #: metric, KL(student || teacher) over its own ``response``-byte samples.
    eval_prompts: int = 32
    hidden_size: int = 64
    num_layers: int = 1
    threads: int = 2
    divergence: str = "reverse"
    beta: float | None = None
    #: Where the divergence is computed: the teacher's top-k ("teacher"), the student's
    #: own top-C at each position ("student") or both ("union"); docs/losses.md.
    support: Support = "teacher"
    #: C: how many of the student's most likely ids are sent as candidates (not "teacher").
    candidates: int = 16
    #: G: continuations sampled per prompt (``batch_size`` must be a multiple of it).
    group_size: int = 1


@dataclass
class OnPolicyResult:
    before: EvalResult
    after: EvalResult
    train_loss: list[float] = field(default_factory=list)
    #: Payload bytes received (response rows only) and what full sequences would carry.
    payload_bytes: int = 0
    #: Request bytes sent (token ids and candidate ids, serialized ``ScoreRequest``s).
    request_bytes: int = 0
    full_sequence_bytes: int = 0
    response_rows: int = 0
    full_rows: int = 0
    seconds: float = 0.0
    generate_seconds: float = 0.0
    #: Steps trained (``cfg.steps`` unless ``after_step`` stopped the run earlier).
    steps_done: int = 0
    #: The teacher's positions answered and computed (forward passes) during the run,
    #: from its /metrics; -1 when its metrics were not reachable.
    teacher_positions_answered: int = -1
    teacher_positions_computed: int = -1


def sample_prompts(
    stream: np.ndarray, rng: np.random.Generator, cfg: OnPolicyConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, max_prompt]`` left-padded byte prompts of random lengths and their mask:
    ``B / G`` prompts, each repeated ``G = cfg.group_size`` times in a row."""
    b, t, g = cfg.batch_size, cfg.max_prompt, cfg.group_size
    lengths = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, size=b // g).repeat(g)
    starts = rng.integers(0, len(stream) - t, size=b // g).repeat(g)
    ids = torch.full((b, t), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((b, t), dtype=torch.int64)
    for i, (n, s) in enumerate(zip(lengths.tolist(), starts.tolist(), strict=True)):
        ids[i, t - n :] = torch.from_numpy(stream[s : s + n].astype(np.int64))
        mask[i, t - n :] = 1
    return ids, mask


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (as ``generate`` does)."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def student_candidates(
    step_logits: tuple[torch.Tensor, ...], total: int, first_row: int, count: int
) -> torch.Tensor:
    """The student's top-``count`` ids at every generated position, as a batch's candidates.

    ``step_logits``: ``generate``'s logits ``[B, V]`` of each of the R steps, the
    distributions the response tokens were sampled from (before any processing). Step
    ``j`` predicts column ``first_row + 1 + j``, so its ids go to row ``first_row + j``
    (row t of a payload is ``p(. | x[0..t])``). Returns ``[B, total, count]`` int64 with
    -1 in every other row.
    """
    ranked = torch.stack(step_logits, dim=1).topk(count, dim=-1).indices  # [B, R, C]
    out = torch.full((ranked.shape[0], total, count), -1, dtype=torch.int64)
    out[:, first_row : first_row + ranked.shape[1]] = ranked
    return out


def _traffic(
    sequences: list[torch.Tensor],
    spans: list[tuple[int, int]],
    k: int,
    candidates: list[torch.Tensor] | None,
) -> tuple[int, int, int]:
    """Payload bytes of the response-only request and of the full-sequence request, and
    the serialized size of the response-only request (candidate ids included)."""
    part = build_request(
        sequences, k, positions=spans, include_sampled=False, candidate_ids=candidates
    )
    full = build_request(sequences, k, include_sampled=False)
    return response_bytes(part), response_bytes(full), part.ByteSize()


#: The teacher's /metrics counters read by :func:`teacher_compute`.
_ANSWERED = "topk_teacher_positions_answered_total"
_COMPUTED = "topk_teacher_positions_computed_total"


def teacher_compute(http: str | None) -> tuple[int, int] | None:
    """The teacher's positions answered and computed so far (its ``/metrics`` at the HTTP
    base URL ``http``), or None (no URL, not reachable, or a backend that does not count)."""
    if not http:
        return None
    try:
        with urllib.request.urlopen(f"{http.rstrip('/')}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    got = [re.search(rf"^{name} ([0-9.e+]+)$", text, re.M) for name in (_ANSWERED, _COMPUTED)]
    if not all(got):
        return None
    return int(float(got[0].group(1))), int(float(got[1].group(1)))  # type: ignore[union-attr]


def run_onpolicy(
    client: Any,
    teacher_dir: Path,
    cfg: OnPolicyConfig,
    teacher_http: str | None = None,
    after_step: Callable[[int, Any], bool] | None = None,
) -> OnPolicyResult:
    """Train a fresh student on-policy against ``client``; before/after held-out metrics
    (and the teacher's compute from its metrics at ``teacher_http``, if given).

    ``after_step(step, student)``, if given, runs after every optimiser step; when it
    returns True the run stops there (``steps_done``) and is evaluated."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.threads)
    corpus: ByteCorpus = load_stdlib_corpus()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    vocab = int(teacher.config.vocab_size)
    divergence = get_divergence(cfg.divergence, **({} if cfg.beta is None else {"beta": cfg.beta}))
    student = student_model(
        vocab,
        DistillConfig(
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            seq_len=cfg.max_prompt + cfg.response,
            seed=cfg.seed,
        ),
    )
    heldout = fixed_windows(corpus.heldout, length=cfg.eval_len, count=cfg.eval_windows)
    prompts = fixed_windows(corpus.heldout, length=cfg.max_prompt, count=cfg.eval_prompts)

    def measure() -> EvalResult:
        return evaluate_with_onpolicy(student, teacher, heldout, prompts, cfg.response)

    result = OnPolicyResult(before=measure(), after=None)  # type: ignore[arg-type]
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    prompt_end = cfg.max_prompt  # the first response column of every row
    # Row t predicts token t+1: the response tokens [P, P+R) are predicted by rows [P-1, P+R-1).
    columns = [(prompt_end - 1, prompt_end + cfg.response - 1)] * cfg.batch_size
    counted = teacher_compute(teacher_http)
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        prompts, prompt_mask = sample_prompts(corpus.train, rng, cfg)
        g0 = time.perf_counter()
        student.eval()
        with torch.no_grad():
            rollout = student.generate(
                input_ids=prompts,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=cfg.response,
                min_new_tokens=cfg.response,
                pad_token_id=PAD_ID,
                return_dict_in_generate=True,
                output_logits=cfg.support != "teacher",
            )
        seqs = rollout.sequences  # [B, P + R]
        student.train()
        result.generate_seconds += time.perf_counter() - g0
        mask = torch.cat([prompt_mask, torch.ones_like(seqs[:, prompt_end:])], dim=1)
        candidates = None
        if cfg.support != "teacher":
            candidates = student_candidates(
                rollout.logits, seqs.shape[1], prompt_end - 1, cfg.candidates
            )  # [B, P + R, C]
        payload = client.score(
            seqs,
            cfg.top_k,
            attention_mask=mask,
            positions=columns,
            include_sampled=False,
            **({} if candidates is None else {"candidate_ids": candidates}),
        )  # [B, P + R, K] (+ [B, P + R, C]), mask True on the response rows only
        logits = student(
            input_ids=seqs, attention_mask=mask, position_ids=_position_ids(mask)
        ).logits
        loss, _stats = topk_kl_loss(
            logits,
            TeacherTargets.from_payload(payload),  # with its candidates, when asked
            LossOptions(divergence=divergence, support=cfg.support),
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        result.train_loss.append(loss.item())
        real = [row[m.bool()] for row, m in zip(seqs, mask, strict=True)]
        spans = [(len(r) - cfg.response - 1, len(r) - 1) for r in real]
        sent = None
        if candidates is not None:
            sent = [c[prompt_end - 1 : prompt_end + cfg.response - 1] for c in candidates]
        part, full, up = _traffic(real, spans, cfg.top_k, sent)
        result.payload_bytes += part
        result.full_sequence_bytes += full
        result.request_bytes += up
        result.response_rows += int(payload.mask.sum())
        result.full_rows += sum(len(r) for r in real)
        result.steps_done = step
        if step % 10 == 0 or step == cfg.steps:
            print(
                f"step {step}/{cfg.steps}: loss {loss.item():.3f}, "
                f"{time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        if after_step is not None and after_step(step, student):
            break
    result.seconds = time.perf_counter() - t0
    now = teacher_compute(teacher_http)
    if counted is not None and now is not None:
        result.teacher_positions_answered = now[0] - counted[0]
        result.teacher_positions_computed = now[1] - counted[1]
    result.after = measure()
    return result


def format_table(result: OnPolicyResult, cfg: OnPolicyConfig) -> str:
    """The before/after table and the traffic line (markdown)."""
    saved = 100 * (1 - result.payload_bytes / max(result.full_sequence_bytes, 1))
    table = heldout_table(result.before, result.after, cfg.eval_windows, cfg.eval_len)
    b, a = result.before.onpolicy_kl, result.after.onpolicy_kl
    own = "KL(student \\|\\| teacher), student's own samples (*)"
    table.insert(-1, f"| {own} | {b:.3f} | {a:.3f} |")
    return "\n".join(
        [
            *table,
            "",
            f"(*) on-policy: {cfg.eval_prompts} held-out prompts of {cfg.max_prompt} bytes, "
            f"{cfg.response} bytes sampled by the student (fixed seed); nats per sampled byte",
            "",
            f"{result.steps_done} steps x {cfg.batch_size} samples: prompts of {cfg.min_prompt}-"
            f"{cfg.max_prompt} bytes, {cfg.response} sampled response bytes, top-{cfg.top_k} "
            f"tail-aware {cfg.divergence} divergence on the {_support_words(cfg)} at the "
            "response positions only; "
            f"{result.seconds:.0f} s "
            f"({result.generate_seconds:.0f} s generating)",
            f"teacher traffic: {result.payload_bytes:,} payload bytes for "
            f"{result.response_rows:,} response rows; full-sequence requests would carry "
            f"{result.full_sequence_bytes:,} bytes for {result.full_rows:,} rows "
            f"({saved:.0f}% saved by the sub-range); {result.request_bytes:,} request bytes "
            f"({bytes_per_row(result.request_bytes, result.response_rows):.1f} per response "
            f"row up, {bytes_per_row(result.payload_bytes, result.response_rows):.1f} down)",
            _compute_line(result, cfg),
        ]
    )


def _compute_line(result: OnPolicyResult, cfg: OnPolicyConfig) -> str:
    answered, computed = result.teacher_positions_answered, result.teacher_positions_computed
    if answered < 0:
        return "teacher compute: not known (its /metrics not reachable: --teacher-http)"
    per = computed / answered if answered else 0.0
    return (
        f"teacher compute (group size {cfg.group_size}): {computed:,} positions computed for "
        f"{answered:,} answered ({per:.2f} per answered position)"
    )


def bytes_per_row(total: int, rows: int) -> float:
    """``total`` bytes per row (0 when there are no rows)."""
    return total / rows if rows else 0.0


def _support_words(cfg: OnPolicyConfig) -> str:
    return {
        "teacher": "teacher's top-k",
        "student": f"student's top-{cfg.candidates}",
        "union": f"teacher's top-k and student's top-{cfg.candidates}",
    }[cfg.support]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m examples.onpolicy", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--teacher", help="teacher target (host:port); default: serve --teacher-dir here"
    )
    ap.add_argument(
        "--token",
        default=os.environ.get("TOPK_TEACHER_TOKEN"),
        help="bearer token of the teacher (default: $TOPK_TEACHER_TOKEN)",
    )
    ap.add_argument(
        "--teacher-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="the teacher's weights (served when --teacher is not given; read locally "
        "for the full-vocabulary evaluation)",
    )
    ap.add_argument(
        "--backend",
        choices=["vllm", "transformers"],
        default="vllm",
        help="engine of the teacher served here (without --teacher)",
    )
    ap.add_argument(
        "--teacher-http",
        help="the teacher's HTTP base URL (http://host:port), to report its positions "
        "computed vs answered from /metrics (default: the teacher served here)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/onpolicy"))
    d = OnPolicyConfig()
    for name in (
        "steps", "batch_size", "min_prompt", "max_prompt", "response", "top_k", "seed",
        "eval_windows", "eval_len", "eval_prompts", "group_size",
    ):  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument(
        "--divergence",
        choices=list(DIVERGENCES),
        default=d.divergence,
        help="reverse KL(student || teacher) (default: see the module doc), forward KL, or JSD",
    )
    ap.add_argument("--beta", type=float, default=d.beta, help="JSD only (default 0.5)")
    ap.add_argument(
        "--support",
        choices=list(SUPPORTS),
        default=d.support,
        help="ids the divergence is computed on: the teacher's top-k, the student's top-C "
        "at each generated position (sent to the teacher as candidates), or both",
    )
    ap.add_argument(
        "--candidates",
        type=int,
        default=d.candidates,
        help="C: the student's top-C ids per position (--support student|union)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    fields = [f.name for f in dataclasses.fields(OnPolicyConfig) if hasattr(args, f.name)]
    cfg = OnPolicyConfig(**{name: getattr(args, name) for name in fields})
    if not 1 <= cfg.min_prompt <= cfg.max_prompt or cfg.response < 1:
        raise SystemExit(
            "--min-prompt/--max-prompt/--response: need 1 <= min <= max, response >= 1"
        )
    if cfg.group_size < 1 or cfg.batch_size % cfg.group_size:
        raise SystemExit(
            f"--group-size: need G >= 1 dividing --batch-size {cfg.batch_size}, got "
            f"{cfg.group_size}"
        )
    if cfg.support != "teacher" and cfg.candidates < 1:
        raise SystemExit(f"--candidates: need C >= 1 with --support {cfg.support}")
    from student_client.clients.blocking import TeacherClient

    server = None
    teacher_dir = args.teacher_dir
    target = args.teacher
    http = args.teacher_http
    if target is None:
        from examples.demo import serve_teacher
        from examples.teacher_pretrain import PretrainConfig, build_default_teacher

        teacher_dir = build_default_teacher(
            teacher_dir, config=PretrainConfig(train_seconds=0, max_steps=300)
        )
        server = serve_teacher(teacher_dir, args.backend, args.out / "teacher-server.log")
        target, http = server.target, http or server.http
    try:
        with TeacherClient(target, token=args.token) as client:
            result = run_onpolicy(client, teacher_dir, cfg, http)
    finally:
        if server is not None:
            server.stop(timeout_s=120)
    print(format_table(result, cfg))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(
        json.dumps({"config": asdict(cfg), "result": asdict(result)}, indent=2) + "\n"
    )
    return 0 if math.isfinite(result.after.kl_teacher_student) else 1


if __name__ == "__main__":
    sys.exit(main())
