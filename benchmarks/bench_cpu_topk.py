"""The CPU top-k kernel against vLLM's own ``Sampler.gather_logprobs`` (``torch.topk``, the
actual token's log-prob and rank): the function a CPU vLLM worker calls for every row of
prompt log-probs. Same inputs, same thread count, in one run; outputs checked equal.

    python -m benchmarks.bench_cpu_topk [--rows 2048] [--vocab 512 32768 151936]
        [--k 8 64] [--threads 1] [--reps 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 32768, 151936])
    ap.add_argument("--k", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--threads", type=int, default=1, help="torch (and numba) threads")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
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
