"""Teacher throughput and payload size: this server vs vLLM's OpenAI-compatible server.

Same tiny model, same engine settings (float32, prefix caching off), same sequences
(default 8 x 2048 random token ids), in one run. For each K it scores every sequence
``--reps`` times through

* this server: one ``ScoreStream`` request carrying all sequences, over loopback gRPC,
  payload decoded to numpy (float16 log-probs);
* vLLM's OpenAI server: one ``/v1/completions`` request per sequence, all in flight at
  once, ``prompt_logprobs=K``, ``max_tokens=1``, JSON decoded;

and prints scored positions per second (median over reps) and bytes per position on the
wire (response bodies; gRPC: serialized messages).

    python -m benchmarks.bench_teacher [--model DIR] [--batch 8] [--seq-len 2048] [--k 8 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from devtools.launch import free_port, start_teacher
from topk_protocol import decode_sequence, encode_token_ids, pb, pb_grpc

ROOT = Path(__file__).resolve().parents[1]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_grpc(model: str, seqs: list[np.ndarray], ks: list[int], reps: int, log: Path) -> dict:
    args = [
        "--backend", "vllm", "--model", model, "--dtype", "float32",
        "--max-top-k", str(max(ks)), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384",
    ]  # fmt: skip
    server = start_teacher(args, log, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    results = {}
    try:
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(server.target, options=opts) as ch:
            stub = pb_grpc.TeacherStub(ch)
            for k in ks:
                req = pb.ScoreRequest(request_id="b", top_k=k, dtype=pb.LOGPROB_DTYPE_FLOAT16)
                for s in seqs:
                    req.sequences.add(token_ids=encode_token_ids(s))
                times, nbytes = [], 0
                for rep in range(reps + 1):  # first rep warms up
                    t0 = time.perf_counter()
                    nbytes = 0
                    rows = 0
                    for msg in stub.ScoreStream(iter([req]), timeout=600):
                        nbytes += msg.ByteSize()
                        for p in msg.sequences:
                            rows += decode_sequence(p).ids.shape[0]
                    if rep:
                        times.append(time.perf_counter() - t0)
                assert rows == sum(len(s) for s in seqs)
                results[k] = (statistics.median(times), nbytes)
    finally:
        server.stop()
    return results


def bench_openai(model: str, seqs: list[np.ndarray], ks: list[int], reps: int, log: Path) -> dict:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-logprobs", str(max(ks)), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384", "--no-enable-prefix-caching",
        "--served-model-name", "tiny",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    results = {}
    url = f"http://127.0.0.1:{port}/v1/completions"

    def one(seq: np.ndarray, k: int) -> int:
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": seq.tolist(),
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": k,
                "prompt_logprobs": k,
            }
        ).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read()
        out = json.loads(raw)
        assert len(out["choices"][0]["prompt_logprobs"]) == len(seq)
        return len(raw)

    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc)
        with cf.ThreadPoolExecutor(len(seqs)) as pool:
            for k in ks:
                times, nbytes = [], 0
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    nbytes = sum(pool.map(one, seqs, [k] * len(seqs)))
                    if rep:
                        times.append(time.perf_counter() - t0)
                results[k] = (statistics.median(times), nbytes)
    finally:
        _stop(proc)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a fresh tiny random Qwen2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--k", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-teacher-"))
    model = args.model
    if model is None:
        from devtools.tiny_model import write_tiny_model

        model = str(write_tiny_model(tmp / "model"))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 256, args.seq_len).astype(np.int32) for _ in range(args.batch)]
    positions = args.batch * args.seq_len
    print(f"# {args.batch} x {args.seq_len} tokens, reps={args.reps}, logs in {tmp}", flush=True)
    ours = bench_grpc(model, seqs, args.k, args.reps, tmp / "grpc.log")
    theirs = bench_openai(model, seqs, args.k, args.reps, tmp / "openai.log")
    print()
    print("| K | server | scored positions/s | bytes/position | speed-up |")
    print("|---|---|---:|---:|---:|")
    for k in args.k:
        (t_o, b_o), (t_v, b_v) = ours[k], theirs[k]
        rows = [
            ("vLLM OpenAI server, prompt_logprobs (JSON)", t_v, b_v),
            ("topk-distill ScoreStream (float16)", t_o, b_o),
        ]
        for name, t, b in rows:
            speed, size = positions / t, b / positions
            print(f"| {k} | {name} | {speed:,.0f} | {size:,.0f} | {t_v / t:.1f}x |")


if __name__ == "__main__":
    main()
