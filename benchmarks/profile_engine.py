"""Where the log-prob path's time goes inside vLLM: per-position times of the worker's
forward pass, its prompt log-probs (logits, ``log_softmax``, top-k) and the front end's
payload build, for forward only, vLLM's top-k and the CPU top-k kernel on one engine.

The engine runs with :class:`ProfilingWorkerExtension`, a subclass of the server's worker
extension that wraps the model runner's methods on its one instance (timers only; the
computation is the server's). Every variant runs once per round, round-robin, and the
medians over rounds are printed in microseconds per position.

    python -m benchmarks.profile_engine [--model DIR] [--batch 8] [--seq-len 2048]
        [--k 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_teacher import add_workload_args, engine_backend, forward_only, workload
from teacher_server.backends.vllm import array_logprobs as vllm_arrays
from teacher_server.backends.vllm.backend import VLLMBackend
from teacher_server.backends.vllm.worker import TeacherWorkerExtension
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions

#: What is timed in the worker: (owner attribute path from the worker, method name, label).
WORKER_TIMERS = [
    ("model_runner", "execute_model", "forward (execute_model)"),
    ("model_runner", "sample_tokens", "sample_tokens"),
    ("model_runner", "_get_prompt_logprobs_dict", "prompt log-probs"),
    ("model_runner.model", "compute_logits", "  logits"),
    ("model_runner.sampler", "compute_logprobs", "  log_softmax"),
    ("model_runner.sampler", "gather_logprobs", "  top-k (gather_logprobs)"),
]
FRONT_END = "front end: payload build"

_totals: dict[str, float] = defaultdict(float)


def _timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)  # sets __wrapped__
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[label] += time.perf_counter() - t0

    return timed


def _owner(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name)
    return root


class ProfilingWorkerExtension(TeacherWorkerExtension):
    """The server's worker extension, with timers around the model runner's methods."""

    def profile_install(self) -> str:
        for path, name, label in WORKER_TIMERS:
            owner = _owner(self, path)
            setattr(owner, name, _timed(getattr(owner, name), label))
        return "ok"

    def profile_take(self) -> dict[str, float]:
        """Seconds per label since the last call."""
        out = dict(_totals)
        _totals.clear()
        return out

    def topk_distill_engine_topk(self, use_kernel: bool) -> str:
        # Route the unwrapped function (the route recognises its own), then time it again.
        sampler: Any = _owner(self, "model_runner.sampler")
        current = sampler.gather_logprobs
        if hasattr(current, "__wrapped__"):
            sampler.gather_logprobs = current.__wrapped__
        answer = super().topk_distill_engine_topk(use_kernel)
        sampler.gather_logprobs = _timed(sampler.gather_logprobs, WORKER_TIMERS[-1][2])
        return answer


async def _profile(backend: VLLMBackend, seqs: list[np.ndarray], k: int, rounds: int) -> dict:
    engine = backend._engine
    await engine.collective_rpc("profile_install")
    ids = iter(range(1 << 62))

    variants = ["forward only", "vLLM's top-k", "CPU top-k kernel"]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(rounds + 1):  # the first round warms up
        for variant in variants:
            if variant != "forward only":
                answers = await backend.route_engine_topk(variant == "CPU top-k kernel")
                assert len(set(answers)) == 1, answers
            await engine.collective_rpc("profile_take")
            _totals.clear()
            t0 = time.perf_counter()
            if variant == "forward only":
                await forward_only(engine, seqs, ids)
            else:
                await asyncio.gather(
                    *(backend.score(ParsedSequence(s, 0, len(s)), RequestOptions(k)) for s in seqs)
                )
            row = {"wall": time.perf_counter() - t0, **_totals}
            row.update((await engine.collective_rpc("profile_take"))[0])
            if rep:
                results[variant].append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from devtools.tiny_model import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="profile-engine-")) / "m"))
    seqs = workload(args.batch, args.seq_len)
    positions = args.batch * args.seq_len
    extension = f"{__name__}.{ProfilingWorkerExtension.__qualname__}"
    backend = engine_backend(model, args.k, worker_extension_cls=extension)
    payload_build = vllm_arrays.topk_payload
    vllm_arrays.topk_payload = _timed(payload_build, FRONT_END)

    async def run() -> dict:
        await backend.start()
        try:
            return await _profile(backend, seqs, args.k, args.rounds)
        finally:
            await backend.close()

    results = asyncio.run(run())
    labels = ["wall"] + [label for *_, label in WORKER_TIMERS] + [FRONT_END]
    print(f"# {args.batch} x {args.seq_len} tokens, K = {args.k}, medians of {args.rounds} rounds")
    print("| us/position | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for label in labels:
        cells = [
            f"{statistics.median(r.get(label, 0.0) for r in rows) / positions * 1e6:.2f}"
            for rows in results.values()
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
