"""Quality per teacher CPU-second: on-policy groups (``--group-size 8``) against one sample
per prompt (``--group-size 1``), the students compared after the same teacher CPU time.

Each seed runs `examples/onpolicy.py` twice against one vLLM-backed teacher server (the demo
teacher, prefix reuse on: the server's default, docs/vllm.md#prefix-reuse), with prompts
long enough for a group to share KV blocks (default 384-512 bytes: three to four 128-token
blocks, where the example's default 32-64-byte prompts fit in less than one):

1. ``G = 1`` for ``--steps`` steps; its teacher CPU-seconds are the budget;
2. ``G = 8`` (``batch / 8`` prompts, 8 samples each) for as many steps as fit in that
   budget (it stops when one more step of its average cost would exceed it; at most
   ``--max-steps-factor`` x ``--steps``); at the G = 1 run's step count it is also
   evaluated, for the same-samples comparison.

The teacher's CPU time is that of the server's whole process tree (the server, vLLM's
engine core and its worker: user + system time from /proc, through psutil), read before
and after every ``score`` call: the budget counts the CPU time spent while the teacher
was answering, cumulative per step, and the table also gives the tree's total over the
run (idle time between calls included). Positions computed and answered come from the
teacher's ``/metrics``. Both students are evaluated with the held-out metrics of
`examples.onpolicy`: the teacher-forced KL in both directions and the on-policy
KL(student || teacher) over their own continuations of held-out prompts.

Run from the repository root (builds the demo teacher first if it is not cached)::

    python -m benchmarks.quality_groups [--steps 40] [--seeds 0 1 2 3 4] [--out runs/quality_groups]

Each run's result is kept in ``--out`` with its configuration and budget, and a re-run
with the same ones reads it instead of training again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.seed_cells import mean_and_range
from examples.distill import EvalResult
from examples.onpolicy import OnPolicyConfig, OnPolicyResult, run_onpolicy
from examples.teacher_pretrain import DEFAULT_CACHE_DIR

__all__ = ["TeacherMeter", "main", "next_step_fits", "tree_cpu_seconds"]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its descendants (children
    that already exited and were waited for count through their parent)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def next_step_fits(cumulative: list[float], budget: float) -> bool:
    """Whether one more step fits ``budget``: the cumulative cost so far plus the average
    cost of a step so far is at most the budget (``cumulative``: the cost after each step)."""
    if not cumulative:
        return True
    return cumulative[-1] + cumulative[-1] / len(cumulative) <= budget


class TeacherMeter:
    """A client that forwards ``score`` and adds up the teacher's CPU seconds during it.

    ``per_step``: the cumulative CPU seconds the teacher's process tree spent inside
    ``score`` calls, after each call (one call per step in `examples/onpolicy.py`)."""

    def __init__(self, client: Any, pid: int) -> None:
        self.client = client
        self.pid = pid
        self.start = tree_cpu_seconds(pid)
        self.per_step: list[float] = []

    def score(self, *args: Any, **kwargs: Any) -> Any:
        before = tree_cpu_seconds(self.pid)
        payload = self.client.score(*args, **kwargs)
        spent = tree_cpu_seconds(self.pid) - before
        self.per_step.append((self.per_step[-1] if self.per_step else 0.0) + spent)
        return payload

    def total(self) -> float:
        """The tree's CPU seconds since the meter started (idle time included)."""
        return tree_cpu_seconds(self.pid) - self.start


@dataclass
class GroupRun:
    """One run: its result, the teacher's CPU seconds per step, and the extra evaluation at
    the G = 1 run's step count (G = 8 only)."""

    result: OnPolicyResult
    teacher_cpu: list[float] = field(default_factory=list)
    teacher_cpu_total: float = 0.0
    budget: float = 0.0
    at_same_steps: EvalResult | None = None
    teacher_cpu_at_same_steps: float = 0.0


def _load(path: Path, cfg: OnPolicyConfig, budget: float) -> GroupRun | None:
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if stored.get("config") != asdict(cfg) or stored["run"]["budget"] != budget:
        return None
    raw = stored["run"]
    res = raw["result"]
    result = OnPolicyResult(
        **{**res, "before": EvalResult(**res["before"]), "after": EvalResult(**res["after"])}
    )
    same = raw["at_same_steps"]
    return GroupRun(
        **{
            **raw,
            "result": result,
            "at_same_steps": None if same is None else EvalResult(**same),
        }
    )


def _run(
    server: Any, teacher_dir: Path, cfg: OnPolicyConfig, budget: float, same_steps: int
) -> GroupRun:
    """Train one student; with ``budget`` > 0 stop when the next step would not fit it,
    and evaluate at ``same_steps`` (> 0) on the way."""
    from student_client.clients.blocking import TeacherClient

    run = GroupRun(result=None, budget=budget)  # type: ignore[arg-type]
    with TeacherClient(server.target) as client:
        meter = TeacherMeter(client, server.proc.pid)
        evaluated: dict[str, Any] = {}

        def after_step(step: int, student: Any) -> bool:
            if step == same_steps:
                evaluated["cpu"] = meter.per_step[-1]
                evaluated["student"] = _snapshot(student)
            return budget > 0 and not next_step_fits(meter.per_step, budget)

        run.result = run_onpolicy(meter, teacher_dir, cfg, server.http, after_step)
        run.teacher_cpu = meter.per_step
        run.teacher_cpu_total = meter.total()
    if "student" in evaluated:
        run.at_same_steps = _evaluate_snapshot(evaluated["student"], teacher_dir, cfg)
        run.teacher_cpu_at_same_steps = evaluated["cpu"]
    return run


def _snapshot(student: Any) -> Any:
    import copy

    return copy.deepcopy(student).eval()


def _evaluate_snapshot(student: Any, teacher_dir: Path, cfg: OnPolicyConfig) -> EvalResult:
    """The held-out metrics of `examples.onpolicy` for a student kept mid-run."""
    import torch
    from transformers import AutoModelForCausalLM

    from examples.data import fixed_windows, load_stdlib_corpus
    from examples.onpolicy_eval import evaluate_with_onpolicy

    corpus = load_stdlib_corpus()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    heldout = fixed_windows(corpus.heldout, length=cfg.eval_len, count=cfg.eval_windows)
    prompts = fixed_windows(corpus.heldout, length=cfg.max_prompt, count=cfg.eval_prompts)
    return evaluate_with_onpolicy(student, teacher, heldout, prompts, cfg.response)


def _per_token(runs: list[GroupRun]) -> str:
    computed = sum(r.result.teacher_positions_computed for r in runs)
    tokens = sum(r.result.full_rows for r in runs)
    return f"{computed / tokens:.2f}" if tokens > 0 and computed >= 0 else "-"


def _wins(g1: list[GroupRun], g8: list[GroupRun], attr: str) -> int:
    """On how many seeds G = 8's final ``attr`` is lower than G = 1's."""
    pairs = zip(g1, g8, strict=True)
    return sum(getattr(e.result.after, attr) < getattr(o.result.after, attr) for o, e in pairs)


def _steps(steps: list[int]) -> str:
    mean = sum(steps) / len(steps)
    text = f"{mean:.0f}" if mean == int(mean) else f"{mean:.1f}"
    return text if min(steps) == max(steps) else f"{text} ({min(steps)}-{max(steps)})"


def format_table(pairs: list[tuple[OnPolicyConfig, GroupRun, GroupRun]]) -> str:
    """One row per (G, budget), the seeds' mean (range)."""
    cfg1 = pairs[0][0]
    g1 = [one for _, one, _ in pairs]
    g8 = [eight for _, _, eight in pairs]
    seeds = ", ".join(str(cfg.seed) for cfg, _, _ in pairs)

    def row(name: str, steps: list[int], cpu: list[float], ev: list[EvalResult], ratio: str) -> str:
        return (
            f"| {name} | {_steps(steps)} | {mean_and_range(cpu, 1) if cpu else ''} | {ratio} "
            f"| {mean_and_range([e.kl_teacher_student for e in ev])} "
            f"| {mean_and_range([e.kl_student_teacher for e in ev])} "
            f"| {mean_and_range([e.onpolicy_kl for e in ev])} |"
        )

    def ratio(runs: list[GroupRun]) -> str:
        computed = sum(r.result.teacher_positions_computed for r in runs)
        answered = sum(r.result.teacher_positions_answered for r in runs)
        return f"{computed / answered:.2f}" if answered > 0 and computed >= 0 else "-"

    lines = [
        f"prompts of {cfg1.min_prompt}-{cfg1.max_prompt} bytes, {cfg1.response}-byte "
        f"responses, {cfg1.batch_size} samples per step, top-{cfg1.top_k} "
        f"{cfg1.divergence} KL on the teacher's support; seeds {seeds} (mean, and range over "
        f"seeds); held-out: {cfg1.eval_windows} windows x {cfg1.eval_len} bytes "
        f"teacher-forced, and {cfg1.eval_prompts} prompts of {cfg1.max_prompt} bytes "
        f"continued by the student for {cfg1.response} bytes (on-policy); nats per byte",
        "",
        "| run | steps | teacher CPU-s | computed / answered | KL(teacher \\|\\| student) "
        "| KL(student \\|\\| teacher) | on-policy KL(student \\|\\| teacher) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        row("(untrained)", [0] * len(g1), [], [r.result.before for r in g1], ""),
        row(
            "G = 1",
            [r.result.steps_done for r in g1],
            [r.teacher_cpu[-1] for r in g1],
            [r.result.after for r in g1],
            ratio(g1),
        ),
    ]
    same = [r for r in g8 if r.at_same_steps is not None]
    if same:
        lines.append(
            row(
                "G = 8, same steps",
                [cfg1.steps] * len(same),
                [r.teacher_cpu_at_same_steps for r in same],
                [r.at_same_steps for r in same],  # type: ignore[misc]
                "",
            )
        )
    lines.append(
        row(
            "G = 8, same teacher CPU",
            [r.result.steps_done for r in g8],
            [r.teacher_cpu[-1] for r in g8],
            [r.result.after for r in g8],
            ratio(g8),
        )
    )
    totals = ", ".join(
        f"seed {cfg.seed}: G = 1 {one.teacher_cpu_total:.1f} s, "
        f"G = 8 {eight.teacher_cpu_total:.1f} s"
        for cfg, one, eight in pairs
    )
    lines += [
        "",
        f"teacher CPU-s: the teacher's process tree during its score calls; over the whole "
        f"runs (idle included): {totals}",
        f"teacher positions computed per token of the sequences sent: G = 1 "
        f"{_per_token(g1)}, G = 8 {_per_token(g8)} (1.00: every token computed)",
        "seeds on which G = 8 at the same teacher CPU ends lower than G = 1: "
        + ", ".join(
            f"{name} {_wins(g1, g8, attr)}/{len(g1)}"
            for name, attr in (
                ("KL(teacher || student)", "kl_teacher_student"),
                ("KL(student || teacher)", "kl_student_teacher"),
                ("on-policy", "onpolicy_kl"),
            )
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.quality_groups", description=__doc__.split("\n\n")[0]
    )
    d = OnPolicyConfig()
    ap.add_argument("--teacher-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--steps", type=int, default=40, help="steps of the G = 1 run")
    ap.add_argument("--max-steps-factor", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=384)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=d.response)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows)
    ap.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", type=Path, default=Path("runs/quality_groups"))
    args = ap.parse_args(argv)
    from examples.demo import serve_teacher
    from examples.teacher_pretrain import PretrainConfig, build_default_teacher

    base = dataclasses.replace(
        d,
        steps=args.steps,
        batch_size=args.batch_size,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        response=args.response,
        top_k=args.top_k,
        eval_windows=args.eval_windows,
        eval_prompts=args.eval_prompts,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    teacher_dir = build_default_teacher(
        args.teacher_dir, config=PretrainConfig(train_seconds=0, max_steps=300)
    )
    pairs: list[tuple[OnPolicyConfig, GroupRun, GroupRun]] = []
    server: Any = None

    def run_or_load(cfg: OnPolicyConfig, budget: float, same_steps: int) -> GroupRun:
        nonlocal server
        path = args.out / f"g{cfg.group_size}-seed{cfg.seed}.json"
        run = _load(path, cfg, budget)
        if run is None:
            if server is None:
                server = serve_teacher(teacher_dir, "vllm", args.out / "teacher-server.log")
            print(f"== {path.stem}", file=sys.stderr, flush=True)
            run = _run(server, teacher_dir, cfg, budget, same_steps)
            path.write_text(
                json.dumps({"config": asdict(cfg), "run": asdict(run)}, indent=2) + "\n"
            )
        return run

    try:
        for seed in args.seeds:
            one_cfg = dataclasses.replace(base, seed=seed, group_size=1)
            one = run_or_load(one_cfg, 0.0, 0)
            eight_cfg = dataclasses.replace(
                one_cfg, group_size=args.group_size, steps=args.steps * args.max_steps_factor
            )
            eight = run_or_load(eight_cfg, one.teacher_cpu[-1], args.steps)
            pairs.append((one_cfg, one, eight))
    finally:
        if server is not None:
            server.stop(timeout_s=120)
    table = format_table(pairs)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
