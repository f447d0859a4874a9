"""Teacher throughput and payload size: the engine's limit, the log-prob paths, and this
server vs vLLM's OpenAI-compatible server.

Same tiny model, same engine settings (float32, prefix caching off), same sequences
(default 8 x 2048 random token ids), in one run.

1. Engine: one in-process vLLM engine with the server's backend; every variant once per
   round, round-robin, ``--engine-reps`` rounds:

   * engine forward only: ``max_tokens=1``, no log-probs (the limit);
   * for each K, to payload arrays: vLLM's ``flat_logprobs`` path with vLLM's own top-k in
     the engine (vLLM's way), the array path with vLLM's top-k, and the array path with
     this project's CPU top-k kernel (the default); all payloads are checked equal.

   Reported (medians over rounds; ratios and differences paired with the same round's
   forward only, which a shared, loaded machine needs): scored positions/s, the ratio to
   forward only, the log-prob path's cost per position
   ``(t_path - t_forward) / positions`` (wall clock) and the CPU time this process
   (vLLM's front-end + the backend; the engine core runs in its own process) spent per
   position beyond forward only.

2. Servers: for each K, every sequence ``--reps`` times through

   * this server (default log-prob path: arrays): one ``ScoreStream`` request carrying
     all sequences, over loopback gRPC, payload decoded to numpy (float16 log-probs);
   * vLLM's OpenAI server: one ``/v1/completions`` request per sequence, all in flight at
     once, ``prompt_logprobs=K``, ``max_tokens=1``, JSON decoded.

   Reported: scored positions per second (median over reps) and bytes per position on
   the wire (response bodies; gRPC: serialized messages).

    python -m benchmarks.bench_teacher [--model DIR] [--batch 8] [--seq-len 2048] [--k 8 64]
        [--reps 3] [--engine-reps 7] [--only engine|servers]
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from devtools.launch import free_port, start_teacher
from teacher_server.backends.vllm.backend import VLLMBackend
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, decode_sequence, encode_token_ids, pb, pb_grpc

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


#: Engine variants per K: (front-end log-prob path, top-k inside the engine); the first is
#: vLLM's own way, the last this server's default.
VARIANTS = [("flat", "vllm"), ("arrays", "vllm"), ("arrays", "kernel")]
LABELS = {
    ("flat", "vllm"): "vLLM flat_logprobs path, vLLM's top-k",
    ("arrays", "vllm"): "array path, vLLM's top-k",
    ("arrays", "kernel"): "array path, CPU top-k kernel (default)",
}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """``--model``, ``--batch``, ``--seq-len``: the workload flags of the engine scripts."""
    ap.add_argument("--model", help="model directory (default: a fresh tiny random Qwen2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)


def model_or_tiny(model: str | None, tmp: Path) -> str:
    """``--model``, or a fresh tiny random Qwen2 written under ``tmp``."""
    if model is not None:
        return model
    from devtools.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp / "model"))


def workload(batch: int, seq_len: int) -> list[np.ndarray]:
    """The benchmark's sequences: ``batch`` x ``seq_len`` random byte-token ids, seed 0."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, seq_len).astype(np.int32) for _ in range(batch)]


def engine_backend(model: str, max_top_k: int, **engine_kwargs: Any) -> VLLMBackend:
    """An in-process backend with the engine settings every run here uses (the servers'
    below get the same flags): float32, 4096 tokens, a 16384-token step, prefix caching
    off (repeated prompts would otherwise make forward only read the cache), the array
    path; ``engine_kwargs`` add vLLM arguments (``enable_prefix_caching=True``: on)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return VLLMBackend(
        model,
        max_top_k=max_top_k,
        dtype="float32",
        max_model_len=4096,
        engine_kwargs={
            "max_num_batched_tokens": 16384,
            "enable_prefix_caching": False,
            **engine_kwargs,
        },
        logprobs_path="arrays",
    )


async def forward_only(engine: Any, seqs: list[np.ndarray], ids: Iterator[int]) -> None:
    """The limit: every sequence through ``engine`` with ``max_tokens=1`` and no log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def one(seq: np.ndarray) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prompt = TokensPrompt(prompt_token_ids=seq.tolist())
        async for _ in engine.generate(prompt, params, request_id=f"fwd-{next(ids)}"):
            pass

    await asyncio.gather(*(one(s) for s in seqs))


def _variant(path: str, topk: str, k: int) -> str:
    return f"{path}+{topk} K={k}"


def _same_except_ties(a: np.ndarray, b: np.ndarray, lps: np.ndarray) -> None:
    """Ids equal wherever a log-prob differs from both neighbours (tie order is free)."""
    gaps = np.diff(lps, axis=1) != 0
    sep = np.ones_like(a, dtype=bool)
    sep[:, 1:] &= gaps
    sep[:, :-1] &= gaps
    np.testing.assert_array_equal(a[sep], b[sep])


async def _engine_variants(
    backend: VLLMBackend, seqs: list[np.ndarray], ks: list[int], reps: int
) -> dict[str, list[tuple[float, float]]]:
    """``{variant: [(wall s, CPU s of this process) per round]}``; variants are
    ``forward`` and :data:`VARIANTS` for each K, run once each per round, round-robin."""
    ids = iter(range(1 << 62))
    # (name, front-end path, engine top-k, K); forward only has no path, top-k or K.
    plan = [("forward", "", "", 0)] + [
        (_variant(p, t, k), p, t, k) for k in ks for p, t in VARIANTS
    ]
    payloads: dict[str, list] = {}
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in plan}
    for rep in range(reps + 1):  # the first round warms up
        for name, path, topk, k in plan:
            if path:
                backend.logprobs_path = path
                answers = await backend.route_engine_topk(topk == "kernel")
                assert set(answers) == {topk}, answers
            t0, c0 = time.perf_counter(), time.process_time()
            if path:
                got = await asyncio.gather(
                    *(backend.score(ParsedSequence(s, 0, len(s)), RequestOptions(k)) for s in seqs)
                )
                payloads[name] = got
            else:
                await forward_only(backend._engine, seqs, ids)
            if rep:
                rounds[name].append((time.perf_counter() - t0, time.process_time() - c0))
    for k in ks:
        flat, arrays, kernel = (payloads[_variant(p, t, k)] for p, t in VARIANTS)
        for f, a, n in zip(flat, arrays, kernel, strict=True):
            # The two front-end paths: identical. The two top-ks: identical log-probs.
            for x in (a, n):
                np.testing.assert_array_equal(x.logprobs, f.logprobs)
                np.testing.assert_array_equal(x.sampled_logprobs, f.sampled_logprobs)
            np.testing.assert_array_equal(a.ids, f.ids)
            _same_except_ties(n.ids, f.ids, f.logprobs)
    return rounds


def bench_engine(model: str, seqs: list[np.ndarray], ks: list[int], reps: int) -> dict:
    """Forward only vs every variant on ONE in-process engine (the server's settings)."""
    backend = engine_backend(model, max(ks))

    async def main() -> dict:
        await backend.start()
        try:
            return await _engine_variants(backend, seqs, ks, reps)
        finally:
            await backend.close()

    return asyncio.run(main())


def print_engine_table(rounds: dict, ks: list[int], positions: int) -> None:
    """Medians over rounds; ratios and costs are paired with the same round's forward."""
    med = statistics.median
    fwd = rounds["forward"]
    print(
        "| K | engine, in-process | scored positions/s | vs forward only "
        "| log-prob path cost, us/position (wall) | front-end CPU, us/position |"
    )
    print("|---|---|---:|---:|---:|---:|")
    print(f"| - | forward only (limit) | {positions / med(t for t, _ in fwd):,.0f} | 1 | - | - |")
    for k in ks:
        for path, topk in VARIANTS:
            name = _variant(path, topk, k)
            pairs = list(zip(rounds[name], fwd, strict=True))
            ratios = [tf / t for (t, _), (tf, _) in pairs]
            cost = med(t - tf for (t, _), (tf, _) in pairs) / positions * 1e6
            cpu = med(c - c_fwd for (_, c), (_, c_fwd) in pairs) / positions * 1e6
            speed = positions / med(t for t, _ in rounds[name])
            print(
                f"| {k} | {LABELS[path, topk]} | {speed:,.0f} | {med(ratios):.2f}x "
                f"| {cost:.2f} | {cpu:.2f} |"
            )
    print(
        f"({len(fwd)} rounds; payloads: the two log-prob paths identical, the two top-ks "
        "identical log-probs and ids (up to the order of exactly equal log-probs))"
    )


def bench_grpc(model: str, seqs: list[np.ndarray], ks: list[int], reps: int, log: Path) -> dict:
    args = [
        "--backend", "vllm", "--model", model, "--dtype", "float32",
        "--max-top-k", str(max(ks)), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384", "--no-enable-prefix-caching",
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
    add_workload_args(ap)
    ap.add_argument("--k", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine-reps", type=int, default=7, help="reps of the engine part")
    ap.add_argument("--only", choices=["engine", "servers"], help="run one part only")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-teacher-"))
    model = model_or_tiny(args.model, tmp)
    seqs = workload(args.batch, args.seq_len)
    positions = args.batch * args.seq_len
    print(
        f"# {args.batch} x {args.seq_len} tokens, reps={args.reps}, "
        f"engine reps={args.engine_reps}, logs in {tmp}",
        flush=True,
    )
    t_forward = None
    if args.only != "servers":
        engine = bench_engine(model, seqs, args.k, args.engine_reps)
        t_forward = statistics.median(t for t, _ in engine["forward"])
        print()
        print_engine_table(engine, args.k, positions)
        print(flush=True)
    if args.only == "engine":
        return
    ours = bench_grpc(model, seqs, args.k, args.reps, tmp / "grpc.log")
    theirs = bench_openai(model, seqs, args.k, args.reps, tmp / "openai.log")
    print()
    print("| K | server | scored positions/s | bytes/position | speed-up | vs forward only |")
    print("|---|---|---:|---:|---:|---:|")
    for k in args.k:
        (t_o, b_o), (t_v, b_v) = ours[k], theirs[k]
        rows = [
            ("vLLM OpenAI server, prompt_logprobs (JSON)", t_v, b_v),
            ("topk-distill ScoreStream (float16)", t_o, b_o),
        ]
        for name, t, b in rows:
            speed, size = positions / t, b / positions
            limit = "-" if t_forward is None else f"{t_forward / t:.2f}x"
            print(f"| {k} | {name} | {speed:,.0f} | {size:,.0f} | {t_v / t:.1f}x | {limit} |")


if __name__ == "__main__":
    main()
