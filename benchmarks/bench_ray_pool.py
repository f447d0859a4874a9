"""Positions/s through a Ray teacher pool against a direct client, in the same run.

Two replicas of the tiny teacher (transformers backend, float32, CPU) run as a
:class:`topk_ray.TeacherPool` on a local Ray cluster, and two more as plain
``teacher-server`` processes started here with the same flags. Each round streams the same
``--batches`` batches (``--batch`` sequences of ``--seq-len`` tokens, K ``--k``, float16)
through a ``TeacherClient`` over the pool's targets and through one over the two direct
servers, in alternating order; the verdict is the median over rounds of the pool's
positions/s divided by the direct client's (target: >= 0.95; the pool adds no hop on the
payload path, so what it can cost is where Ray places and how it runs the replicas).

    python -m benchmarks.bench_ray_pool [--rounds 6] [--batches 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from devtools.launch import start_teacher
from devtools.tiny_model import write_tiny_model
from student_client import TeacherClient


def _rate(targets: list[str], batches: list[list[list[int]]], k: int, depth: int) -> float:
    with TeacherClient(targets) as client:
        client.info()
        start = time.perf_counter()
        positions = sum(int(p.mask.sum()) for p in client.stream(batches, k, depth=depth))
        return positions / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    from topk_ray import PoolConfig, TeacherPool, connect

    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-pool-"))
    model = write_tiny_model(tmp / "model", seed=0)
    serve = ["--backend", "transformers", "--model", str(model), "--dtype", "float32"]
    rng = np.random.default_rng(0)
    batches = [
        [rng.integers(0, 256, size=args.seq_len).tolist() for _ in range(args.batch)]
        for _ in range(args.batches)
    ]
    connect(num_cpus=2, object_store_memory=80 * 1024 * 1024)
    direct = [start_teacher(serve, tmp / f"direct-{i}.log") for i in range(2)]
    try:
        with TeacherPool(PoolConfig(serve, replicas=2, log_dir=str(tmp / "pool"))) as pool:
            pool_targets = pool.targets()
            direct_targets = [d.target for d in direct]
            ratios, rates = [], {"pool": [], "direct": []}  # type: ignore[var-annotated]
            for r in range(args.rounds):
                order = ["pool", "direct"] if r % 2 == 0 else ["direct", "pool"]
                got = {}
                for name in order:
                    t = pool_targets if name == "pool" else direct_targets
                    got[name] = _rate(t, batches, args.k, args.depth)
                    rates[name].append(got[name])
                ratios.append(got["pool"] / got["direct"])
                print(
                    f"round {r}: pool {got['pool']:.0f} positions/s, direct "
                    f"{got['direct']:.0f} positions/s, ratio {ratios[-1]:.3f}",
                    flush=True,
                )
    finally:
        for d in direct:
            d.stop()
    load = os.getloadavg()[0]
    print(
        f"\n| client | positions/s (median of {args.rounds}) |\n|---|---:|\n"
        f"| direct (2 teacher-server processes) | {statistics.median(rates['direct']):.0f} |\n"
        f"| through the Ray pool (2 replicas) | {statistics.median(rates['pool']):.0f} |\n\n"
        f"pool / direct: median {statistics.median(ratios):.3f} (rounds: "
        f"{', '.join(f'{x:.3f}' for x in ratios)}); target >= 0.95; load average {load:.1f}"
    )


if __name__ == "__main__":
    main()
