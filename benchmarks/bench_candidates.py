"""Teacher throughput with candidate ids: the same requests with ``C`` candidates per
position and without, against one vLLM teacher server, in one run.

One ``teacher-server serve --backend vllm`` (the tiny model unless ``--model``, float32
engine, the default array log-prob path and CPU top-k kernel). Each round sends the
workload (``--batch`` x ``--seq-len`` random token ids, every position, K ``--k``,
float16 on the wire) once without candidates and once with ``--candidates`` ids per
position (a random half of them from the vocabulary, the other half repeating ids the
teacher ranks high, plus ~10% ``-1`` padding), in alternating order; the first round
warms up. Reported: scored positions/s (median over rounds), the ratio with / without
(paired within each round), and request and answer bytes per position (serialized
messages). Then, in this process (one thread), what the worker adds per engine call:
the candidate gather and the concatenation onto the rows, against the CPU top-k kernel
on the same ``[rows, 512]`` float32 log-probs (best of 5).

    python -m benchmarks.bench_candidates [--model DIR] [--batch 4] [--seq-len 1024]
        [--k 64] [--candidates 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from benchmarks.bench_teacher import add_workload_args, model_or_tiny, workload
from devtools.launch import start_teacher
from topk_protocol import build_request, decode_sequence, pb, pb_grpc


def _candidates(seqs: list[np.ndarray], c: int, seed: int = 1) -> list[np.ndarray]:
    """``[L, C]`` ids per sequence: half uniform over the byte vocabulary the workload
    uses, half from a fixed small set (ids a peaked teacher ranks high), ~10% ``-1``."""
    rng = np.random.default_rng(seed)
    out = []
    for s in seqs:
        ids = rng.integers(0, 256, size=(len(s), c))
        ids[:, : c // 2] = rng.integers(0, 16, size=(len(s), c // 2))
        ids[rng.random(ids.shape) < 0.1] = -1
        out.append(ids.astype(np.int32))
    return out


def _run(stub: pb_grpc.TeacherStub, req: pb.ScoreRequest, rows: int) -> tuple[float, int]:
    """One request over ``ScoreStream``: (seconds, answer bytes); every row decoded."""
    cands = {
        i: np.frombuffer(s.candidate_ids, "<i4").reshape(-1, s.num_candidates)
        for i, s in enumerate(req.sequences)
        if s.num_candidates
    }
    done = {i: 0 for i in range(len(req.sequences))}
    t0 = time.perf_counter()
    nbytes = got = 0
    for msg in stub.ScoreStream(iter([req]), timeout=1200):
        nbytes += msg.ByteSize()
        for p in msg.sequences:
            i, n = int(p.sequence_index), int(p.num_positions)
            c = cands.get(i)
            got += len(decode_sequence(p, None if c is None else c[done[i] : done[i] + n]))
            done[i] += n
    seconds = time.perf_counter() - t0
    if got != rows:
        raise RuntimeError(f"got {got} rows, expected {rows}")
    return seconds, nbytes


def _worker_cost(rows: int, k: int, c: int) -> tuple[float, float]:
    """Seconds (best of 7, one thread) of the worker's candidate step (gather, ``-1`` to
    NaN, concatenation onto the ``[rows, K + 1]`` top-k rows) and of the top-k kernel
    that makes those rows, on the same ``[rows, 512]`` log-probs."""
    import torch

    from teacher_server.backends import cpu_topk
    from teacher_server.backends.base import gather_candidates

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(rows, 512, generator=gen) * 3, -1)
    cand = torch.randint(-1, 512, (rows, c), generator=gen)
    targets = torch.randint(0, 512, (rows,), generator=gen)
    got = cpu_topk.topk_with_target(lp, k, targets)
    if got is None:
        raise RuntimeError("the top-k kernel refused the benchmark's rows")
    ids, values, _ = got

    def candidates() -> None:
        torch.cat((ids, cand.to(ids.dtype)), 1)
        torch.cat((values, gather_candidates(lp, cand)), 1)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(candidates), best(lambda: cpu_topk.topk_with_target(lp, k, targets))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.set_defaults(batch=4, seq_len=1024)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--candidates", type=int, default=64, help="C per position")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-candidates-"))
    model = model_or_tiny(args.model, tmp)
    seqs = workload(args.batch, args.seq_len)
    rows = sum(len(s) for s in seqs)
    plain = build_request(seqs, args.k, dtype="float16", request_id="plain")
    with_c = build_request(
        seqs,
        args.k,
        dtype="float16",
        request_id="cand",
        candidate_ids=_candidates(seqs, args.candidates),
    )
    server_args = [
        "--backend", "vllm", "--model", model, "--dtype", "float32",
        "--max-top-k", str(args.k), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384",
    ]  # fmt: skip
    print(
        f"# {args.batch} x {args.seq_len} tokens, K {args.k}, C {args.candidates}, "
        f"{args.rounds} rounds after a warm-up, logs in {tmp}",
        flush=True,
    )
    server = start_teacher(server_args, tmp / "server.log", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    times: dict[str, list[float]] = {"plain": [], "cand": []}
    answer: dict[str, int] = {}
    try:
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(server.target, options=opts) as ch:
            stub = pb_grpc.TeacherStub(ch)
            for r in range(args.rounds + 1):
                order = [("plain", plain), ("cand", with_c)]
                for name, req in order if r % 2 else order[::-1]:
                    t, answer[name] = _run(stub, req, rows)
                    if r:
                        times[name].append(t)
    finally:
        server.stop()
    ratios = [p / c for p, c in zip(times["plain"], times["cand"], strict=True)]
    print()
    print("| request | scored positions/s | request bytes/position | answer bytes/position |")
    print("|---|---:|---:|---:|")
    for name, req, label in (
        ("plain", plain, "top-k only"),
        ("cand", with_c, f"top-k + C = {args.candidates} candidates"),
    ):
        speed = rows / statistics.median(times[name])
        print(
            f"| {label} | {speed:,.0f} | {req.ByteSize() / rows:,.1f} | "
            f"{answer[name] / rows:,.1f} |"
        )
    print(
        f"\nwith / without candidates: {statistics.median(ratios):.2f}x positions/s "
        f"(median of {len(ratios)} paired rounds; min {min(ratios):.2f}x, "
        f"max {max(ratios):.2f}x)"
    )
    extra, topk = _worker_cost(rows, args.k, args.candidates)
    print(
        f"worker, {rows} rows of V = 512: candidate gather + concatenation "
        f"{extra * 1e3:.1f} ms, top-k kernel {topk * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
