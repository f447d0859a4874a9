"""Which support for on-policy distillation? Reverse KL and JSD on the teacher's top-k, the
student's own top-C, and their union, against the forward KL, with the same budget.

Each run is `examples/onpolicy.py` with one (divergence, support) pair: a fresh student
(same seed) samples responses to the same prompts, a teacher served over gRPC scores only
the response rows (and, for the student and union supports, the student's top-C ids at
each of them, sent as candidates), and the tail-aware loss trains on that support. The
held-out metrics are teacher-forced full-vocabulary KL in both directions and the
student's cross-entropy (`examples.distill.evaluate`), and the on-policy KL(student ||
teacher) over the student's own continuations of held-out prompts
(`examples.onpolicy_eval`). Bytes per response row are counted
both ways: the serialized requests up, the payload arrays down.

Run from the repository root (builds the demo teacher first if it is not cached)::

    python -m benchmarks.quality_support [--steps 40] [--seeds 0 1 2] [--out runs/quality_support]

One teacher server (the transformers backend, by default) serves every run. Each run's
result is kept in ``--out/<label>.json`` together with its configuration, and a re-run
with the same configuration reads it instead of training again, so the grid can be
resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.seed_cells import mean_and_range
from examples.distill import EvalResult
from examples.onpolicy import OnPolicyConfig, OnPolicyResult, bytes_per_row, run_onpolicy
from examples.teacher_pretrain import DEFAULT_CACHE_DIR
from student_client.losses.types import Support

__all__ = ["GRID", "format_table", "main"]

#: (divergence, beta, support) of every run; the forward KL on the teacher's top-k is the
#: baseline the others are measured against.
GRID: list[tuple[str, float | None, Support]] = [
    ("forward", None, "teacher"),
    ("reverse", None, "teacher"),
    ("reverse", None, "student"),
    ("reverse", None, "union"),
    ("jsd", 0.5, "teacher"),
    ("jsd", 0.5, "student"),
    ("jsd", 0.5, "union"),
]


def _label(cfg: OnPolicyConfig) -> str:
    name = cfg.divergence if cfg.beta is None else f"{cfg.divergence}{cfg.beta:g}"
    return f"{name}-{cfg.support}"


def _file(cfg: OnPolicyConfig) -> str:
    """The run's result file: the label, and the seed when it is not 0."""
    return _label(cfg) + ("" if cfg.seed == 0 else f"-seed{cfg.seed}") + ".json"


def _load(path: Path, cfg: OnPolicyConfig) -> OnPolicyResult | None:
    """The stored result of a run with exactly ``cfg``, or None."""
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if stored.get("config") != asdict(cfg):
        return None
    raw = stored["result"]
    return OnPolicyResult(
        **{
            **raw,
            "before": EvalResult(**raw["before"]),
            "after": EvalResult(**raw["after"]),
        }
    )


def format_table(runs: list[list[tuple[OnPolicyConfig, OnPolicyResult]]]) -> str:
    """The markdown table: one row per (divergence, support), the seeds' mean (range)."""
    first = runs[0][0][0]
    seeds = [cfg.seed for cfg, _ in runs[0]]
    befores = [res.before for _, res in runs[0]]
    lines = [
        f"{first.steps} steps x {first.batch_size} samples, prompts of {first.min_prompt}-"
        f"{first.max_prompt} bytes, {first.response}-byte responses, top-{first.top_k} "
        f"teacher ids, top-{first.candidates} student candidates, tail mode, seeds "
        f"{', '.join(map(str, seeds))} (mean, and range over seeds); held-out "
        f"{first.eval_windows} windows x {first.eval_len} bytes teacher-forced, and "
        f"{first.eval_prompts} prompts of {first.max_prompt} bytes continued by the student "
        f"for {first.response} bytes (on-policy); nats per byte (lower is better).",
        "",
        "| divergence | support | KL(teacher \\|\\| student) | KL(student \\|\\| teacher) "
        "| on-policy KL(student \\|\\| teacher) | student CE | bytes/row up | bytes/row down |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| (untrained) | | {mean_and_range([b.kl_teacher_student for b in befores])} "
        f"| {mean_and_range([b.kl_student_teacher for b in befores])} "
        f"| {mean_and_range([b.onpolicy_kl for b in befores])} "
        f"| {mean_and_range([b.student_ce for b in befores])} | | |",
    ]
    for seeds_of_row in runs:
        cfg = seeds_of_row[0][0]
        results = [res for _, res in seeds_of_row]
        name = "forward KL" if cfg.divergence == "forward" else "reverse KL"
        if cfg.divergence == "jsd":
            name = f"JSD({cfg.beta:g})"
        up = bytes_per_row(results[0].request_bytes, results[0].response_rows)
        down = bytes_per_row(results[0].payload_bytes, results[0].response_rows)
        lines.append(
            f"| {name} | {cfg.support} "
            f"| {mean_and_range([r.after.kl_teacher_student for r in results])} "
            f"| {mean_and_range([r.after.kl_student_teacher for r in results])} "
            f"| {mean_and_range([r.after.onpolicy_kl for r in results])} "
            f"| {mean_and_range([r.after.student_ce for r in results])} | {up:.1f} | {down:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.quality_support", description=__doc__.split("\n\n")[0]
    )
    d = OnPolicyConfig()
    ap.add_argument("--teacher-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--backend", choices=["vllm", "transformers"], default="transformers")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--candidates", type=int, default=d.candidates)
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed (default: 0)"
    )
    ap.add_argument(
        "--only", nargs="+", default=None, help="run only these labels (e.g. reverse-union)"
    )
    ap.add_argument("--out", type=Path, default=Path("runs/quality_support"))
    args = ap.parse_args(argv)
    from examples.demo import serve_teacher
    from examples.teacher_pretrain import PretrainConfig, build_default_teacher
    from student_client.clients.blocking import TeacherClient

    base = dataclasses.replace(
        d,
        steps=args.steps,
        batch_size=args.batch_size,
        top_k=args.top_k,
        candidates=args.candidates,
    )
    grid = [
        dataclasses.replace(base, divergence=div, beta=beta, support=support)
        for div, beta, support in GRID
    ]
    if args.only:
        grid = [c for c in grid if _label(c) in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    teacher_dir = build_default_teacher(
        args.teacher_dir, config=PretrainConfig(train_seconds=0, max_steps=300)
    )
    runs: list[list[tuple[OnPolicyConfig, OnPolicyResult]]] = []
    server: Any = None
    try:
        for row in grid:
            runs.append([])
            for seed in args.seeds:
                cfg = dataclasses.replace(row, seed=seed)
                path = args.out / _file(cfg)
                result = _load(path, cfg)
                if result is None:
                    if server is None:
                        server = serve_teacher(
                            teacher_dir, args.backend, args.out / "teacher-server.log"
                        )
                    print(f"== {path.stem}", file=sys.stderr, flush=True)
                    with TeacherClient(server.target) as client:
                        result = run_onpolicy(client, teacher_dir, cfg)
                    path.write_text(
                        json.dumps({"config": asdict(cfg), "result": asdict(result)}, indent=2)
                        + "\n"
                    )
                runs[-1].append((cfg, result))
    finally:
        if server is not None:
            server.stop(timeout_s=120)
    table = format_table(runs)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
