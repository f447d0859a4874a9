"""What the memory trim (``--memory-trim-idle-s``) costs the teacher: scoring right after a
``malloc_trim`` vs without one.

One in-process vLLM engine with the server's backend and settings (``bench_teacher``'s
workload: default 8 x 2048 random token ids, K = 64, the default log-prob path). Each
round, round-robin, ``--reps`` rounds after one of warm-up:

* ``plain``: score the workload;
* ``trimmed``: trim vLLM's worker process (``VLLMBackend.trim_memory``, as the server does)
  and this process, then score the workload: the trim's call plus the page faults of
  memory that it gave back and the next batch takes again. A server trims only after
  ``--memory-trim-idle-s`` without requests, not before every batch as here: this is
  the first batch after an idle spell, and the worst case.

Reported: medians of positions/s and the ratio ``trimmed / plain`` paired per round, the
trim's own wall time and what it gave back.

    python -m benchmarks.bench_memory_trim [--batch 8] [--seq-len 2048] [--k 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_teacher import add_workload_args, engine_backend, workload
from teacher_server.backends.vllm.backend import VLLMBackend
from teacher_server.malloc_trim import malloc_trim
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions

MIB = 1024 * 1024


async def _score(backend: VLLMBackend, seqs: list[np.ndarray], k: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(
        *(backend.score(ParsedSequence(s, 0, len(s)), RequestOptions(k)) for s in seqs)
    )
    return time.perf_counter() - t0


async def _rounds(backend: VLLMBackend, seqs: list[np.ndarray], k: int, reps: int) -> dict:
    out: dict[str, list[float]] = {"plain": [], "trimmed": [], "trim_s": [], "given": []}
    for rep in range(reps + 1):  # the first round warms up
        plain = await _score(backend, seqs, k)
        t0 = time.perf_counter()
        given = await backend.trim_memory() + await asyncio.to_thread(malloc_trim)
        trim_s = time.perf_counter() - t0
        trimmed = trim_s + await _score(backend, seqs, k)
        if rep:
            for name, v in zip(out, (plain, trimmed, trim_s, given), strict=True):
                out[name].append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from devtools.tiny_model import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "model", seed=0))
        seqs = workload(args.batch, args.seq_len)
        backend = engine_backend(model, args.k)

        async def run() -> dict:
            await backend.start()
            try:
                return await _rounds(backend, seqs, args.k, args.reps)
            finally:
                await backend.close()

        r = asyncio.run(run())
    med = statistics.median
    positions = args.batch * args.seq_len
    ratio = med(p / t for p, t in zip(r["plain"], r["trimmed"], strict=True))
    print(f"| {args.batch} x {args.seq_len}, K = {args.k} | positions/s | vs plain |")
    print("|---|---:|---:|")
    print(f"| plain | {positions / med(r['plain']):,.0f} | 1 |")
    print(f"| trimmed right before (trim included) | {positions / med(r['trimmed']):,.0f} | "
          f"{ratio:.2f}x |")  # fmt: skip
    print(
        f"({args.reps} rounds, medians; the trim itself: {med(r['trim_s']) * 1e3:.1f} ms, "
        f"gave back {med(r['given']) / MIB:.1f} MiB per round (median))"
    )


if __name__ == "__main__":
    main()
