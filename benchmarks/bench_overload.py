"""Teacher under overload: many trainer ranks prefetching against one replica.

One vLLM teacher (started here on the tiny model, CPU, ``--max-inflight-requests 64``)
gets ``--streams`` concurrent ``ScoreStream`` clients (one channel each, like separate
trainer ranks), each sending ``--batches`` batches at prefetch depth ``--depth``: with
the defaults 256 x 4 = 1024 requests want service at once, 16x the in-flight limit.
Baseline, same run, same server: every batch scored alone, one request at a time. Checked:
every stream finishes with no error, and every payload equals the one computed alone.
Reported: wall time, per-batch latency (p50, p99, max: from the stream's start to the
payload), positions/s of both, and the server's answer codes from ``/metrics``.

    python -m benchmarks.bench_overload [--streams 256] [--depth 4] [--batches 4]
        [--max-inflight-requests 64] [--max-queued-requests 1024] [--client-retries 4]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from devtools.launch import start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import TeacherClient
from student_client.data.payload import TeacherPayload


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4, help="batches per stream")
    ap.add_argument("--batch", type=int, default=2, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--max-inflight-requests", type=int, default=64)
    ap.add_argument("--max-queued-requests", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--client-retries", type=int, default=4, help="TeacherClient retries (its default: 4)"
    )
    return ap


def make_batches(args: argparse.Namespace, vocab: int) -> list[list[torch.Tensor]]:
    """``[stream][batch]`` -> ``[batch, seq_len]`` int64 token ids, all distinct."""
    rng = np.random.default_rng(args.seed)
    return [
        [
            torch.from_numpy(rng.integers(0, vocab, (args.batch, args.seq_len)))
            for _ in range(args.batches)
        ]
        for _ in range(args.streams)
    ]


async def run_streams(
    target: str, batches: list[list[torch.Tensor]], args: argparse.Namespace
) -> tuple[float, list[float], list[list[TeacherPayload]], list[BaseException]]:
    """All streams at once; (wall s, per-batch latencies, payloads, errors)."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    results: list[list[TeacherPayload]] = [[] for _ in batches]

    async def one(i: int) -> None:
        async with AsyncTeacherClient(target, timeout_s=600, retries=args.client_retries) as client:
            t0 = time.perf_counter()
            try:
                async for payload in client.stream(
                    batches[i], args.k, depth=args.depth, dtype="float32"
                ):
                    latencies.append(time.perf_counter() - t0)
                    results[i].append(payload)
            except Exception as e:  # counted and reported, not hidden
                errors.append(e)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(batches))))
    return time.perf_counter() - t0, latencies, results, errors


def answer_codes(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'topk_teacher_requests_total\{code="(\w+)",method="(\w+)"\} (\S+)', text):
        out[f"{m[2]}:{m[1]}"] = float(m[3])
    return out


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", seed=0)
        server = start_teacher(
            [
                "--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS,
                "--max-inflight-requests", str(args.max_inflight_requests),
                "--max-queued-requests", str(args.max_queued_requests),
            ],
            Path(tmp) / "server.log",
        )  # fmt: skip
        try:
            with TeacherClient(server.target, timeout_s=600) as client:
                vocab = client.info().vocab_size
                batches = make_batches(args, vocab)
                n_req = sum(len(b) for b in batches)
                positions = n_req * args.batch * args.seq_len
                print(
                    f"{args.streams} streams x {args.batches} batches of {args.batch} x "
                    f"{args.seq_len} tokens, K={args.k}, depth {args.depth}: {n_req} requests; "
                    f"server --max-inflight-requests {args.max_inflight_requests} "
                    f"--max-queued-requests {args.max_queued_requests}; client retries "
                    f"{args.client_retries}"
                )
                t0 = time.perf_counter()
                alone = [
                    [client.score(b, args.k, dtype="float32") for b in stream] for stream in batches
                ]
                t_alone = time.perf_counter() - t0
            before = answer_codes(f"{server.http}/metrics")
            wall, lat, results, errors = asyncio.run(run_streams(server.target, batches, args))
            after = answer_codes(f"{server.http}/metrics")
        finally:
            server.stop()

    exact = max_diff = 0.0
    mismatched = 0
    for got_s, want_s in zip(results, alone, strict=True):
        for got, want in zip(got_s, want_s, strict=False):
            same_ids = torch.equal(got.ids, want.ids)
            diff = float((got.logprobs - want.logprobs).abs().max())
            max_diff = max(max_diff, diff)
            exact += same_ids and diff == 0.0
            mismatched += not same_ids
    got_n = sum(len(r) for r in results)
    lat_ms = np.array(lat) * 1000
    codes = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    print("| run | requests | errors | wall s | positions/s | latency p50 / p99 / max, ms |")
    print("|---|---:|---:|---:|---:|---|")
    print(
        f"| each batch alone, one at a time (baseline) | {n_req} | 0 | {t_alone:.1f} | "
        f"{positions / t_alone:,.0f} | {t_alone / n_req * 1000:.0f} (mean) |"
    )
    print(
        f"| {args.streams} streams x depth {args.depth} | {got_n} | {len(errors)} | {wall:.1f} | "
        f"{got_n * args.batch * args.seq_len / wall:,.0f} | "
        f"{np.percentile(lat_ms, 50):.0f} / {np.percentile(lat_ms, 99):.0f} / {lat_ms.max():.0f} |"
    )
    print(
        f"payloads equal to the ones computed alone: {int(exact)} of {got_n} bit for bit; "
        f"ids differ in {mismatched}; max |log-prob difference| {max_diff:.2e}"
    )
    print(f"server answers during the concurrent run (method:code -> count): {codes}")
    for e in errors[:5]:
        print(f"error: {type(e).__name__}: {e}")
    ok = not errors and got_n == n_req and mismatched == 0
    print("RESULT:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
