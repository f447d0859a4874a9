"""Student-side throughput of 1 vs 2 data-parallel processes against one teacher.

Starts one vLLM teacher (the tiny model, CPU), then runs ``examples.ddp_training_loop``
under ``torchrun --nproc-per-node W`` for each ``W`` of ``--world-sizes`` (default 1 2):
every rank its own client and prefetch window (``--depth``), DDP on gloo. Reported per W:
trained positions/s per process and in total (steady state: the first ``--warmup``
steps left out), and the teacher's ``topk_teacher_requests_in_flight`` /
``topk_teacher_requests_queued`` gauges sampled from ``/metrics`` every 0.1 s during
the run (mean and max). The baseline is W = 1 in the same run.

    flock /tmp/bench.lock python -m benchmarks.bench_data_parallel [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.bench_client import start_vllm
from devtools.launch import TeacherProcess

ROOT = Path(__file__).resolve().parents[1]
GAUGES = ("topk_teacher_requests_in_flight", "topk_teacher_requests_queued")


class GaugeSampler:
    """Samples the teacher's load gauges from ``/metrics`` in a thread until stopped."""

    def __init__(self, server: TeacherProcess, every_s: float = 0.1) -> None:
        self._url = f"{server.http}/metrics"
        self._every_s = every_s
        self._stop = threading.Event()
        self.samples: dict[str, list[float]] = {name: [] for name in GAUGES}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with urllib.request.urlopen(self._url, timeout=5) as r:
                text = r.read().decode()
            for name in GAUGES:
                match = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.MULTILINE)
                if match:
                    self.samples[name].append(float(match.group(1)))
            self._stop.wait(self._every_s)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_world(server: TeacherProcess, world: int, args: argparse.Namespace, out: Path) -> dict:
    """One torchrun of the DDP loop with ``world`` ranks; its per-rank throughput."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "-m", "examples.ddp_training_loop",
        "--teacher", server.target, "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--top-k", str(args.top_k), "--depth", str(args.depth), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    with GaugeSampler(server) as gauges:
        subprocess.run(cmd, env=env, check=True, capture_output=True)
    positions_per_step = args.batch_size * args.seq_len
    per_rank = []
    for rank in range(world):
        steps = json.loads((out / f"rank{rank}.json").read_text())["step_seconds"]
        steady = steps[args.warmup :]
        per_rank.append(positions_per_step * len(steady) / sum(steady))
    return {
        "world": world,
        "per_rank": per_rank,
        "total": sum(per_rank),
        "gauges": {
            name: (statistics.fmean(v) if v else float("nan"), max(v, default=float("nan")))
            for name, v in gauges.samples.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()

    from devtools.tiny_model import write_tiny_model

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-model", seed=0)
        server = start_vllm(model, max(64, args.top_k), Path(tmp) / "server.log")
        try:
            for world in args.world_sizes:
                rows.append(run_world(server, world, args, Path(tmp) / f"w{world}"))
        finally:
            server.stop()
    print(
        f"## Data parallel: ToyStudent, {args.batch_size} x {args.seq_len} tokens per rank "
        f"and step, K={args.top_k}, depth {args.depth}, {args.steps} steps "
        f"({args.warmup} warm-up), one vLLM tiny teacher on CPU; load {os.getloadavg()}\n"
    )
    print(
        "| processes | positions/s per process | total positions/s | vs 1 process "
        "| in flight mean / max | queued mean / max |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    base = rows[0]["total"]
    for row in rows:
        per = " / ".join(f"{p:,.0f}" for p in row["per_rank"])
        fl, qu = (row["gauges"][name] for name in GAUGES)
        print(
            f"| {row['world']} | {per} | {row['total']:,.0f} | {row['total'] / base:.2f}x "
            f"| {fl[0]:.2f} / {fl[1]:.0f} | {qu[0]:.2f} / {qu[1]:.0f} |"
        )


if __name__ == "__main__":
    main()
