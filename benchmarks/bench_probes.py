"""Probe latency under request shapes that load the event loop.

One vLLM teacher on the tiny model (CPU). A :class:`devtools.probes.ProbeWatcher` asks
``/healthz``, ``/readyz`` and gRPC health every 50 ms throughout; reported: the slowest
probe of each phase (the target is under 1 s) next to the baseline measured in the same
run with the server idle:

1. idle (baseline);
2. one ``Score`` of ``--sequences`` (10,000) one-token sequences;
3. one ``ScoreStream`` of ``--stream-requests`` (100,000) tiny requests (one sequence of
   one token each), read as fast as they come;
4. one request of ``--big-mb`` (62) MiB of token ids (refused: over the token limit;
   what counts is that decoding and validating it does not hold the probes).

    python -m benchmarks.bench_probes [--sequences 10000] [--stream-requests 100000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from devtools.launch import start_teacher
from devtools.probes import ProbeWatcher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from topk_protocol import build_request, pb, pb_grpc


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--stream-requests", type=int, default=100_000)
    ap.add_argument("--big-mb", type=int, default=62)
    ap.add_argument("--idle-s", type=float, default=3.0)
    return ap


def tiny_requests(n: int) -> Iterator[pb.ScoreRequest]:
    for i in range(n):
        req = build_request([np.array([i % 512], np.int32)], 1, dtype="float16")
        req.request_id = str(i)
        yield req


def run_phase(name: str, server: object, work: object) -> tuple[str, float, float, str]:
    with ProbeWatcher(server.http, server.target) as probes:  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        detail = work()  # type: ignore[operator]
        wall = time.perf_counter() - t0
    return name, wall, probes.max_s(), f"{probes.summary()}; {detail}"


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", seed=0)
        server = start_teacher(
            ["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS],
            Path(tmp) / "server.log",
        )
        try:
            with grpc.insecure_channel(
                server.target,
                options=[
                    ("grpc.max_send_message_length", 128 * 1024 * 1024),
                    ("grpc.max_receive_message_length", 128 * 1024 * 1024),
                ],
            ) as ch:
                stub = pb_grpc.TeacherStub(ch)

                def idle() -> str:
                    time.sleep(args.idle_s)
                    return "no requests"

                def many_sequences() -> str:
                    seqs = [np.array([i % 512], np.int32) for i in range(args.sequences)]
                    resp = stub.Score(build_request(seqs, 16, dtype="float16"), timeout=600)
                    return f"{len(resp.sequences)} sequences answered"

                def long_stream() -> str:
                    n = 0
                    for msg in stub.ScoreStream(tiny_requests(args.stream_requests), timeout=3600):
                        n += msg.final and not msg.HasField("error")
                    return f"{n} of {args.stream_requests} requests answered OK"

                def big_request() -> str:
                    n = args.big_mb * 1024 * 1024 // 4
                    req = pb.ScoreRequest(top_k=1)
                    req.sequences.add(token_ids=np.zeros(n, np.int32).tobytes())
                    try:
                        stub.Score(req, timeout=600)
                        return "answered"
                    except grpc.RpcError as e:
                        return f"{e.code().name}: {(e.details() or '')[:80]}"

                rows = [
                    run_phase("idle (baseline)", server, idle),
                    run_phase(
                        f"Score of {args.sequences:,} one-token sequences", server, many_sequences
                    ),
                    run_phase(
                        f"ScoreStream of {args.stream_requests:,} tiny requests",
                        server,
                        long_stream,
                    ),
                    run_phase(f"one {args.big_mb} MiB request", server, big_request),
                ]
        finally:
            server.stop()
    base = rows[0][2]
    print("| phase | wall s | slowest probe, ms | vs idle | detail |")
    print("|---|---:|---:|---:|---|")
    for name, wall, worst, detail in rows:
        print(f"| {name} | {wall:.1f} | {worst * 1e3:.0f} | {worst / base:.1f}x | {detail} |")


if __name__ == "__main__":
    main()
