"""Prefix reuse: groups, multi-turn and a mixed load, against reuse off and against vLLM's
forward-only limit with the prefix cache on and off, on one engine in one run.

One in-process vLLM engine with the server's backend (tiny model, float32, prefix cache
on, array path, K = 64). Every variant once per round, round-robin, ``--reps`` rounds
after one warm-up round; every variant gets prompts of its own (fresh random ids) so
that nothing it reads was cached by another variant. The backend is what the server
calls: one ``ScoreBatch`` of G rows is G concurrent ``score`` calls (``one request``);
G requests from G ranks arrive one after the other (``G requests``: 1 ms apart). The
gRPC layer is the same in every variant and is measured by ``bench_teacher``.

- **groups**: G completions of R tokens behind one P-token prompt, positions ``[P, P+R)``
  of each: reuse off (today's server: every request computes every token) vs reuse on;
  limits: vLLM's forward pass (``max_tokens=1``, no log-probs) over the same sequences
  with the cache off, and with it on (the prompt first, then its completions).
- **multi-turn**: a conversation of ``--turns`` turns of ``--turn-tokens`` new tokens,
  scored after each turn (positions: the new tokens); reuse off vs on; limit: forward only
  with the cache on, turn after turn.
- **mixed**: ``--unrelated`` full-sequence requests of P + R tokens sent together with
  one group; the unrelated requests' positions/s with reuse on vs off.
- **vLLM's OpenAI server** (unless ``--no-openai``): the same groups and conversations as
  ``/v1/completions`` requests with ``prompt_logprobs=K``, ``max_tokens=1`` (vLLM's own
  server recomputes every prompt position of a request with prompt log-probs), all of a
  group in flight at once, JSON decoded; its own engine process (same settings), idle
  while the other variants run.

Reported: medians over rounds of answered positions/s, and ratios paired within a round.
Every reuse-on payload is checked against the reuse-off one (log-probs within 1e-4, ids
where the rank is unambiguous) once per run.

    python -m benchmarks.bench_prefix_reuse [--model DIR] [--prompt 1024] [--completion 256]
        [--group 8] [--k 64] [--turns 4] [--turn-tokens 512] [--unrelated 4] [--reps 5]
        [--no-openai]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_teacher import ROOT, _stop, _wait_http, engine_backend, model_or_tiny
from devtools.launch import free_port
from teacher_server.backends.vllm.backend import VLLMBackend
from teacher_server.backends.vllm.prefix import PrefixOrder
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays

VOCAB = 256  # byte tokens: inside every model's vocabulary here


class Bench:
    """One engine; switches prefix reuse on and off between variants."""

    def __init__(self, backend: VLLMBackend, k: int, seed: int = 0) -> None:
        self.backend = backend
        order = backend._order
        if order is None:
            raise RuntimeError("prefix reuse is off in this engine: nothing to measure")
        self.block_size = order.block_size
        self.opts = RequestOptions(k, "float32")
        self.rng = np.random.default_rng(seed)
        self.ids = itertools.count()

    def reuse(self, on: bool) -> None:
        """Reuse on (a fresh ordering: nothing a previous variant registered) or off (no
        cap: every position computed, as with ``--no-enable-prefix-caching``)."""
        self.backend._order = PrefixOrder(self.block_size) if on else None

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n).astype(np.int32)

    def group(self, prompt: int, completion: int, g: int) -> list[np.ndarray]:
        head = self.tokens(prompt)
        return [np.concatenate([head, self.tokens(completion)]) for _ in range(g)]

    async def score(self, seqs: list[np.ndarray], start: int, stagger_s: float = 0) -> list:
        async def one(seq: np.ndarray) -> SequenceArrays:
            return await self.backend.score(ParsedSequence(seq, start, len(seq)), self.opts)

        tasks = []
        for seq in seqs:
            tasks.append(asyncio.create_task(one(seq)))
            if stagger_s:
                await asyncio.sleep(stagger_s)
        return list(await asyncio.gather(*tasks))

    async def forward(self, seqs: list[np.ndarray], cache: bool) -> None:
        """vLLM's forward pass only (``max_tokens=1``, no log-probs), all at once; the
        prefix cache read (``cache``) or skipped."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=not cache
        )

        async def one(seq: np.ndarray) -> None:
            gen = self.backend._engine.generate(
                tokens_input(seq.tolist()), params, request_id=f"fwd-{next(self.ids)}"
            )
            async for _ in gen:
                pass

        await asyncio.gather(*(one(s) for s in seqs))


class OpenAIServer:
    """vLLM's OpenAI server on ``model`` (the in-process engine's settings), scoring with
    ``prompt_logprobs=K``: every prompt position, recomputed."""

    def __init__(self, model: str, k: int, log: Path) -> None:
        port = free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-logprobs", str(k), "--max-model-len", "4096",
            "--max-num-batched-tokens", "16384", "--served-model-name", "tiny",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.k = k
        self.pool = cf.ThreadPoolExecutor(16)
        _wait_http(f"http://127.0.0.1:{port}/health", self.proc)

    def _one(self, seq: np.ndarray) -> None:
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": seq.tolist(),
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": self.k,
                "prompt_logprobs": self.k,
            }
        ).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        if len(out["choices"][0]["prompt_logprobs"]) != len(seq):
            raise RuntimeError("vLLM's OpenAI server returned the wrong number of rows")

    async def score(self, seqs: list[np.ndarray]) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.pool, self._one, s) for s in seqs))

    def close(self) -> None:
        self.pool.shutdown()
        _stop(self.proc)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


def plan(
    b: Bench, a: argparse.Namespace, openai: OpenAIServer | None
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """``{variant: coroutine factory}``: one timed run each (fresh prompts per call)."""
    p, r, g = a.prompt, a.completion, a.group

    def groups(on: bool, stagger: float) -> Callable[[], Awaitable[Any]]:
        async def run() -> None:
            b.reuse(on)
            await b.score(b.group(p, r, g), p, stagger)

        return run

    async def fwd_off() -> None:
        await b.forward(b.group(p, r, g), cache=False)

    async def fwd_on() -> None:
        seqs = b.group(p, r, g)
        await b.forward([seqs[0][:p]], cache=True)  # the prompt first
        await b.forward(seqs, cache=True)

    async def group_openai() -> None:
        assert openai is not None
        await openai.score(b.group(p, r, g))

    def turns(kind: str) -> Callable[[], Awaitable[Any]]:
        async def run() -> None:
            b.reuse(kind == "on")
            seq = b.tokens(a.turn_tokens)
            for turn in range(a.turns):
                start = 0 if turn == 0 else len(seq)
                if turn:
                    seq = np.concatenate([seq, b.tokens(a.turn_tokens)])
                if kind.startswith("forward"):
                    await b.forward([seq], cache=kind == "forward on")
                elif kind == "openai":
                    assert openai is not None
                    await openai.score([seq])
                else:
                    await b.score([seq], start)

        return run

    variants: dict[str, Callable[[], Awaitable[Any]]] = {
        "group, reuse off": groups(False, 0),
        "group, reuse on, one request": groups(True, 0),
        f"group, reuse on, {g} requests": groups(True, 1e-3),
        "group, forward only, cache off": fwd_off,
        "group, forward only, cache on": fwd_on,
        "multi-turn, reuse off": turns("off"),
        "multi-turn, reuse on": turns("on"),
        "multi-turn, forward only, cache off": turns("forward off"),
        "multi-turn, forward only, cache on": turns("forward on"),
    }
    if openai is not None:
        variants["group, vLLM OpenAI server (prompt_logprobs)"] = group_openai
        variants["multi-turn, vLLM OpenAI server (prompt_logprobs)"] = turns("openai")
    return variants


async def mixed(b: Bench, a: argparse.Namespace, on: bool) -> float:
    """Seconds until the unrelated full-sequence requests are answered, sent together with
    one group (reuse ``on`` or off)."""
    b.reuse(on)
    p, r = a.prompt, a.completion
    unrelated = [b.tokens(p + r) for _ in range(a.unrelated)]
    group = b.group(p, r, a.group)
    t0 = time.perf_counter()
    side = asyncio.create_task(b.score(group, p, 1e-3))
    await b.score(unrelated, 0)
    t = time.perf_counter() - t0
    await side
    return t


async def check_exact(b: Bench, a: argparse.Namespace) -> None:
    """Reuse-on payloads of one group against reuse off: equal up to float32 drift."""
    seqs = b.group(a.prompt, a.completion, a.group)
    b.reuse(False)
    want = await b.score(seqs, a.prompt)
    b.reuse(True)
    got = await b.score(seqs, a.prompt, 1e-3)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4, rtol=0)
        clear = np.abs(np.diff(y.logprobs, axis=1)) > 2e-4
        sep = np.ones_like(y.ids, dtype=bool)
        sep[:, 1:] &= clear
        sep[:, :-1] &= clear
        np.testing.assert_array_equal(x.ids[sep], y.ids[sep])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


async def run(a: argparse.Namespace, model: str, tmp: Path) -> None:
    openai = None if a.no_openai else OpenAIServer(model, a.k, tmp / "openai.log")
    backend = engine_backend(model, a.k, enable_prefix_caching=True)
    try:
        await backend.start()
        b = Bench(backend, a.k)
        variants = plan(b, a, openai)
        times: dict[str, list[float]] = {name: [] for name in variants}
        mix: dict[bool, list[float]] = {False: [], True: []}
        print(f"# load before: {uptime()}", flush=True)
        for rep in range(a.reps + 1):  # round 0 warms up
            for name, fn in variants.items():
                t = await timed(fn)
                if rep:
                    times[name].append(t)
            for on in (False, True):
                t = await mixed(b, a, on)
                if rep:
                    mix[on].append(t)
        await check_exact(b, a)
        print(f"# load after: {uptime()}", flush=True)
        report(a, times, mix)
    finally:
        await backend.close()
        if openai is not None:
            openai.close()


def report(a: argparse.Namespace, times: dict[str, list[float]], mix: dict) -> None:
    """The table: per variant, answered positions/s, its speedup over reuse off and that
    speedup as a share of the limit's (vLLM's forward pass alone with the cache read vs
    skipped), each ratio paired within a round; and, for where the time goes, its time
    against the forward pass alone with the cache read."""
    med = statistics.median
    g, p, r = a.group, a.prompt, a.completion
    answered = {"group": g * r, "multi-turn": a.turns * a.turn_tokens}

    def per_round(num: str, den: str) -> list[float]:  # time(den) / time(num), by round
        return [d / n for n, d in zip(times[num], times[den], strict=True)]

    def ratio(num: str, den: str) -> float:
        return med(per_round(num, den))

    print()
    print(
        "| workload | variant | answered positions/s | time, s | speedup vs reuse off "
        "| share of the limit's speedup | time vs forward only, cache on |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        work = name.split(",")[0]
        off, fwd_off, fwd_on = (f"{work}, reuse off", f"{work}, forward only, cache off",
                                f"{work}, forward only, cache on")  # fmt: skip
        speed = answered[work] / med(ts)
        share = "-"
        if "reuse on" in name:
            pairs = zip(per_round(name, off), per_round(fwd_on, fwd_off), strict=True)
            share = f"{med(x / lim for x, lim in pairs):.2f}x"
        vs_fwd = "-" if "forward" in name else f"{ratio(name, fwd_on):.2f}x"
        print(f"| {work} | {name.split(', ', 1)[1]} | {speed:,.0f} | {med(ts):.3f} "
              f"| {ratio(name, off):.2f}x | {share} | {vs_fwd} |")  # fmt: skip
    for work in answered:
        lim = ratio(f"{work}, forward only, cache on", f"{work}, forward only, cache off")
        print(f"\nthe limit ({work}): vLLM's forward pass alone, cache read vs skipped: {lim:.2f}x")
    unrelated = a.unrelated * (p + r)
    on, off = med(mix[True]), med(mix[False])
    keep = med(f / o for o, f in zip(mix[True], mix[False], strict=True))
    print(
        f"mixed load: {a.unrelated} unrelated requests of {p + r} tokens beside one group: "
        f"{unrelated / off:,.0f} positions/s with reuse off, {unrelated / on:,.0f} with it on "
        f"({keep:.2f}x)"
    )
    print(f"({a.reps} rounds; payloads with reuse equal those without, checked)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a fresh tiny random Qwen2)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--unrelated", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-openai", action="store_true", help="skip vLLM's OpenAI server")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    model = model_or_tiny(a.model, tmp)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    print(
        f"# groups: G={a.group}, P={a.prompt}, R={a.completion}, K={a.k}; multi-turn: "
        f"{a.turns} x {a.turn_tokens}; mixed: {a.unrelated} unrelated; {a.reps} rounds",
        flush=True,
    )
    asyncio.run(run(a, model, tmp))


if __name__ == "__main__":
    main()
