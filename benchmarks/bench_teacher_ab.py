"""Teacher throughput, A/B: this source tree's server against another tree's (an older
commit), both running at once, requests interleaved.

A throughput change of a few percent is smaller than the drift of a shared machine
between two separate runs of :mod:`benchmarks.bench_teacher`. Here both servers are up
at the same time (each its own vLLM engine; an idle engine costs no CPU), and every round
sends the same ``ScoreStream`` request to one and then to the other, the order
alternating between rounds. Each round's ratio is paired (same moment, same load), and
the median of the ratios is reported with its spread. CPU time is less noisy than wall
time on a shared machine: each server's front-end process (gRPC, validation, packing:
this project's code) and its vLLM engine processes are also reported in CPU
milliseconds per request (``psutil``, user + system; means over the rounds).

Then the student client's payload decode (:func:`benchmarks.bench_client.bench_decode`,
the batch's answer to padded tensors) of each tree, in a fresh process per tree and
round, the order alternating, paired the same way (``--decode-rounds``; 0 skips it).

    git worktree add --detach /tmp/base <old-commit>
    python -m benchmarks.bench_teacher_ab --baseline-src /tmp/base [--batch 8]
        [--seq-len 2048] [--k 64] [--rounds 15] [--decode-rounds 9]

Both trees run on this environment's packages (the baseline's imports come from its
tree: ``PYTHONPATH``, and the servers start in a neutral working directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

from benchmarks.bench_teacher import add_workload_args, model_or_tiny, workload
from devtools.launch import TeacherProcess, start_teacher
from topk_protocol import decode_sequence, encode_token_ids, pb, pb_grpc

HERE = Path(__file__).resolve().parents[1]


def start_from(src: Path, model: str, k: int, log: Path) -> TeacherProcess:
    """The teacher server of source tree ``src`` (same engine settings as
    :func:`benchmarks.bench_teacher.bench_grpc`)."""
    args = [
        "--backend", "vllm", "--model", model, "--dtype", "float32",
        "--max-top-k", str(k), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384",
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": str(src)}
    return start_teacher(args, log, env=env, cwd=log.parent)


def one_request(stub: pb_grpc.TeacherStub, req: pb.ScoreRequest, positions: int) -> float:
    """Seconds for one ``ScoreStream`` request, answer decoded to numpy."""
    t0 = time.perf_counter()
    rows = 0
    for msg in stub.ScoreStream(iter([req]), timeout=600):
        for p in msg.sequences:
            rows += decode_sequence(p).ids.shape[0]
    if rows != positions:
        raise RuntimeError(f"got {rows} rows, expected {positions}")
    return time.perf_counter() - t0


def cpu_s(pid: int) -> tuple[float, float]:
    """(front end, engine) CPU seconds so far of server ``pid`` and of its children."""
    proc = psutil.Process(pid)
    own = sum(proc.cpu_times()[:2])
    children = sum(sum(c.cpu_times()[:2]) for c in proc.children(recursive=True))
    return own, children


def decode_rate(src: Path, batch: int, seq_len: int, k: int) -> float:
    """Positions/s of tree ``src``'s client decode of one ``batch x seq_len`` answer at
    ``k`` (median of 5), measured in a fresh interpreter running that tree's code."""
    code = (
        "from benchmarks.bench_client import bench_decode; "
        f"print(bench_decode({batch}, {seq_len}, {k}, 5)[0][1])"
    )
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def paired(base: list[float], cand: list[float]) -> str:
    """``cand / base`` per round: the median with its quartiles and range."""
    ratios = sorted(c / b for b, c in zip(base, cand, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return (
        f"median {q[1]:.3f}x (quartiles {q[0]:.3f}x-{q[2]:.3f}x, "
        f"range {ratios[0]:.3f}x-{ratios[-1]:.3f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--baseline-src", type=Path, required=True, help="the other source tree")
    ap.add_argument("--candidate-src", type=Path, default=HERE, help="default: this tree")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--decode-rounds", type=int, default=9, help="0: no decode pairing")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-teacher-ab-"))
    model = model_or_tiny(args.model, tmp)
    seqs: list[np.ndarray] = workload(args.batch, args.seq_len)
    positions = args.batch * args.seq_len
    req = pb.ScoreRequest(request_id="ab", top_k=args.k, dtype=pb.LOGPROB_DTYPE_FLOAT16)
    for seq in seqs:
        req.sequences.add(token_ids=encode_token_ids(seq))
    names = ("baseline", "candidate")
    srcs = (args.baseline_src.resolve(), args.candidate_src.resolve())
    logs = [tmp / f"{n}.log" for n in names]
    servers = [start_from(src, model, args.k, log) for src, log in zip(srcs, logs, strict=True)]
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    try:
        channels = [grpc.insecure_channel(s.target, options=opts) for s in servers]
        stubs = [pb_grpc.TeacherStub(ch) for ch in channels]
        for stub in stubs:  # warm-up, not timed
            one_request(stub, req, positions)
        for r in range(args.rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for i in order:
                before = cpu_s(servers[i].proc.pid)
                times[names[i]].append(one_request(stubs[i], req, positions))
                after = cpu_s(servers[i].proc.pid)
                cpu[names[i]].append((after[0] - before[0], after[1] - before[1]))
        for ch in channels:
            ch.close()
    finally:
        for server in servers:
            server.stop()
    decode: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.decode_rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            decode[names[i]].append(decode_rate(srcs[i], args.batch, args.seq_len, args.k))
    # Throughput ratios: the inverse of the time ratios.
    speed = {n: [1 / t for t in times[n]] for n in names}
    print(f"# {args.batch} x {args.seq_len} tokens, K = {args.k}, {args.rounds} rounds; logs {tmp}")
    print(f"# baseline:  {srcs[0]}\n# candidate: {srcs[1]}")
    print("| server | scored positions/s | front-end CPU, ms/request | engine CPU, ms/request |")
    print("|---|---:|---:|---:|")
    for n in names:
        # Means: the clock's tick (10 ms) is coarse against one request.
        front = statistics.fmean(c[0] for c in cpu[n]) * 1e3
        engine = statistics.fmean(c[1] for c in cpu[n]) * 1e3
        speed = positions / statistics.median(times[n])
        print(f"| {n} | {speed:,.0f} | {front:.1f} | {engine:.1f} |")
    print(
        "candidate / baseline throughput, paired per round: "
        + paired(speed["baseline"], speed["candidate"])
    )
    if args.decode_rounds:
        for n in names:
            print(f"| {n} client decode | {statistics.median(decode[n]):,.0f} positions/s |")
        print(
            "candidate / baseline client decode, paired per round: "
            + paired(decode["baseline"], decode["candidate"])
        )


if __name__ == "__main__":
    main()
