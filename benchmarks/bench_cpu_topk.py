"""The CPU top-k kernel against vLLM's own ``Sampler.gather_logprobs`` (``torch.topk``, the
actual token's log-prob and rank): the function a CPU vLLM worker calls for every row of
prompt log-probs. Same inputs, same thread count, in one run; outputs checked equal.

    python -m benchmarks.bench_cpu_topk [--rows 2048] [--vocab 512 32768 151936]
        [--k 8 64] [--threads 1] [--reps 10]

``--serve``: the same choice inside a serving engine. A tiny random Qwen2 (hidden 128)
with a ``--serve-vocab`` vocabulary (default 151,936, Qwen's) is served by one
in-process engine with the server's backend and ``--engine-topk auto`` (its start-up
timing picks one; the pick and its reason are printed); then the engine's top-k is
routed to the kernel, to vLLM's and to auto's pick in turn, once each per round,
round-robin, each scoring ``--serve-batch`` x ``--serve-seq-len`` random tokens at
``K = --serve-k``; payloads checked equal. Printed: positions/s of each (medians) and
auto / max(kernel, vllm), from the medians and paired within each round.

    python -m benchmarks.bench_cpu_topk --serve [--serve-vocab 151936] [--serve-k 64]
        [--serve-batch 4] [--serve-seq-len 1024] [--serve-rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from teacher_server.backends.vllm.worker import KERNEL, route_gather_logprobs


def _time(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    """Best of ``reps`` calls of ``fn(*args)``, seconds (after one warm-up call)."""
    fn(*args)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_serve(args: argparse.Namespace) -> None:
    """``--serve``: kernel, vLLM's and auto's pick in one engine at ``--serve-vocab``."""
    from benchmarks.bench_teacher import engine_backend, workload
    from devtools.tiny_model import write_tiny_model
    from teacher_server.validation import ParsedSequence
    from topk_protocol import RequestOptions

    k = args.serve_k
    seqs = workload(args.serve_batch, args.serve_seq_len)
    positions = sum(len(s) for s in seqs)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(f"{tmp}/model", seed=0, vocab_size=args.serve_vocab)
        # One engine step of 2048 rows (the start-up timing's rows are its own).
        backend = engine_backend(str(model), k, max_num_batched_tokens=2048)

        async def run() -> tuple[str, str, dict[str, list[float]], dict[str, list]]:
            await backend.start()
            picked, reason = backend.engine_topk, backend.engine_topk_reason
            times: dict[str, list[float]] = {"kernel": [], "vllm": [], "auto": []}
            payloads: dict[str, list] = {}
            try:
                for rnd in range(args.serve_rounds + 1):  # the first round warms up
                    for name in times:
                        topk = picked if name == "auto" else name
                        answers = await backend.route_engine_topk(topk == KERNEL)
                        assert set(answers) == {topk}, answers
                        t0 = time.perf_counter()
                        payloads[name] = await asyncio.gather(
                            *(
                                backend.score(ParsedSequence(s, 0, len(s)), RequestOptions(k))
                                for s in seqs
                            )
                        )
                        if rnd:
                            times[name].append(time.perf_counter() - t0)
            finally:
                await backend.close()
            return picked, reason, times, payloads

        picked, reason, times, payloads = asyncio.run(run())
    speed = {name: positions / statistics.median(t) for name, t in times.items()}
    print(f"# auto picked {picked}: {reason}")
    print(
        f"# V = {args.serve_vocab:,}, K = {k}, {args.serve_batch} x {args.serve_seq_len} "
        f"tokens a round, medians of {args.serve_rounds} rounds"
    )
    print("| engine top-k | positions/s | us/position |")
    print("|---|---:|---:|")
    for name, ps in speed.items():
        label = f"auto (picked {picked})" if name == "auto" else name
        print(f"| {label} | {ps:,.0f} | {1e6 / ps:.1f} |")
    best = max(speed["kernel"], speed["vllm"])
    print(f"auto / max(kernel, vllm): {speed['auto'] / best:.3f}x (medians)")
    rounds = zip(times["auto"], times["kernel"], times["vllm"], strict=True)
    paired = statistics.median(min(tk, tv) / ta for ta, tk, tv in rounds)
    print(f"auto / max(kernel, vllm), paired within a round: {paired:.3f}x (median)")
    for a, b in zip(payloads["kernel"], payloads["vllm"], strict=True):
        assert (a.logprobs == b.logprobs).all()
        # Ids up to the order of equal log-probs; the last column's id may be another of
        # several ids tied at the K-th value (the 65th is not in the payload to tell).
        gaps = np.diff(b.logprobs, axis=1) != 0
        sep = np.ones_like(a.ids, dtype=bool)
        sep[:, 1:] &= gaps
        sep[:, :-1] &= gaps
        sep[:, -1] = False
        np.testing.assert_array_equal(a.ids[sep], b.ids[sep])
    print("payloads checked: log-probs equal, ids equal up to the order of equal log-probs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 32768, 151936])
    ap.add_argument("--k", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--threads", type=int, default=1, help="torch (and numba) threads")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--serve", action="store_true", help="the engine-level comparison")
    ap.add_argument("--serve-vocab", type=int, default=151_936)
    ap.add_argument("--serve-k", type=int, default=64)
    ap.add_argument("--serve-batch", type=int, default=4)
    ap.add_argument("--serve-seq-len", type=int, default=1024)
    ap.add_argument("--serve-rounds", type=int, default=5)
    args = ap.parse_args()
    if args.serve:
        bench_serve(args)
        return
    from vllm.v1.sample.sampler import Sampler

    torch.set_num_threads(args.threads)
    stock = Sampler().gather_logprobs
    sampler = Sampler()
    if (answer := route_gather_logprobs(sampler, True)) != KERNEL:
        raise SystemExit(f"the kernel is not available: {answer}")
    kernel = sampler.gather_logprobs
    print(f"# {args.rows} rows, {args.threads} thread(s), best of {args.reps}")
    print("| V | K | vLLM gather_logprobs, us/row | CPU top-k kernel, us/row | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for v in args.vocab:
        # Teacher-like rows: log_softmax of scaled normal logits.
        logprobs = torch.log_softmax(torch.randn(args.rows, v, generator=gen) * 3, -1)
        target = torch.randint(0, v, (args.rows,), generator=gen)
        for k in args.k:
            want, got = stock(logprobs, k, target), kernel(logprobs, k, target)
            for field in ("logprobs", "selected_token_ranks"):
                assert torch.equal(getattr(want, field), getattr(got, field)), field
            inputs = (logprobs, k, target)
            t_stock = _time(stock, inputs, args.reps) / args.rows * 1e6
            t_kernel = _time(kernel, inputs, args.reps) / args.rows * 1e6
            print(f"| {v:,} | {k} | {t_stock:.2f} | {t_kernel:.2f} | {t_stock / t_kernel:.1f}x |")


if __name__ == "__main__":
    main()
