"""Positions/s through a Ray teacher pool against a direct client, paired and interleaved.

Two replicas of the tiny teacher (transformers backend, float32, CPU) run as a
:class:`topk_ray.TeacherPool` on a local Ray cluster, and two more as plain
``teacher-server`` processes started here with the same flags and the same torch thread
count (one: what Ray gives an actor of one CPU). The run is a series of short **pairs**:
each pair streams the same ``--batches`` batches (``--batch`` sequences of ``--seq-len``
tokens, K ``--k``, float16) once through a ``TeacherClient`` over the pool's targets and
once through one over the two direct servers, back to back, the order alternating from
pair to pair. A pair's ratio is pool positions/s over direct positions/s measured a few
seconds apart, so a change in the machine's load touches both sides of most pairs; the
verdict is the median of the paired ratios with their quartiles (target: median >= 0.95).

    python -m benchmarks.bench_ray_pool [--pairs 30] [--batches 4]
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


def _rate(client: TeacherClient, batches: list[list[list[int]]], k: int, depth: int) -> float:
    start = time.perf_counter()
    positions = sum(int(p.mask.sum()) for p in client.stream(batches, k, depth=depth))
    return positions / (time.perf_counter() - start)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--batches", type=int, default=4, help="batches per side of a pair")
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
    load_before = os.getloadavg()
    connect(num_cpus=2, object_store_memory=80 * 1024 * 1024)
    direct = [
        start_teacher(serve, tmp / f"direct-{i}.log", env={"OMP_NUM_THREADS": "1"})
        for i in range(2)
    ]
    ratios, rates = [], {"pool": [], "direct": []}  # type: ignore[var-annotated]
    try:
        with TeacherPool(PoolConfig(serve, replicas=2, log_dir=str(tmp / "pool"))) as pool:
            targets = {"pool": pool.targets(), "direct": [d.target for d in direct]}
            with (
                TeacherClient(targets["pool"]) as via_pool,
                TeacherClient(targets["direct"]) as via_direct,
            ):
                clients = {"pool": via_pool, "direct": via_direct}
                for c in clients.values():  # connect and warm both sides once
                    _rate(c, batches, args.k, args.depth)
                for r in range(args.pairs):
                    order = ["pool", "direct"] if r % 2 == 0 else ["direct", "pool"]
                    got = {
                        name: _rate(clients[name], batches, args.k, args.depth) for name in order
                    }
                    for name, rate in got.items():
                        rates[name].append(rate)
                    ratios.append(got["pool"] / got["direct"])
                    print(
                        f"pair {r} ({order[0]} first): pool {got['pool']:.0f}, direct "
                        f"{got['direct']:.0f} positions/s, ratio {ratios[-1]:.3f}",
                        flush=True,
                    )
    finally:
        for d in direct:
            d.stop()
        import ray

        ray.shutdown()
    load_after = os.getloadavg()
    q1, med, q3 = _quartiles(ratios)
    n = args.pairs
    print(
        f"\n| client | positions/s (median of {n}) |\n|---|---:|\n"
        f"| direct (2 teacher-server processes) | {statistics.median(rates['direct']):.0f} |\n"
        f"| through the Ray pool (2 replicas) | {statistics.median(rates['pool']):.0f} |\n\n"
        f"pool / direct over {n} pairs: median {med:.3f}, quartiles {q1:.3f} .. {q3:.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}; target median >= 0.95\n"
        f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} "
        f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}"
    )


if __name__ == "__main__":
    main()
