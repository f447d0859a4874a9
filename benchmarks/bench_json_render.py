"""Rendering the JSON answers of the routes other servers call: the per-entry f-string
renderers (:mod:`benchmarks.json_render_reference`) against the vectorized ones
(:mod:`teacher_server.http_api.json_arrays`), one sequence each, one thread.

Rows (``--positions`` 2,047 and K = 64 by default; the payload of
:func:`benchmarks.bench_packing.payload`: ids uniform over a Qwen-sized vocabulary, the
sorted top 64 of a Zipf-like log-softmax):

* SGLang ``/generate`` with ``return_logprob`` and ``top_logprobs_num`` K:
  ``input_token_logprobs`` and ``input_top_logprobs``;
* vLLM ``/v1/completions`` with token ids and ``prompt_logprobs`` K (the prompt token
  and the top K per position, as TRL's client asks);
* the same with ``echo`` and ``prompt_logprobs`` K (every entry's ``decoded_token``; a
  stand-in tokenizer writes each id as ``tok<id>``, decoded once per id beforehand as
  a warm server has).

Per renderer: the median of ``--reps`` renders in ms per sequence, the answer's bytes
per position, and the longest wait of a thread waking every 0.5 ms while the renders
run again (a probe's event loop: how long a render holds the interpreter's lock at a
stretch). Both answers are checked to be the same JSON (every float read as float32),
laid out byte for byte alike apart from the floats, before timing.

    python -m benchmarks.bench_json_render [--positions 2047] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

from benchmarks import json_render_reference as reference
from benchmarks.bench_packing import K, payload
from teacher_server.http_api.sglang.protocol import GenerateItem, GenerateRequest
from teacher_server.http_api.sglang.serving import render_generate
from teacher_server.http_api.text import TokenTexts
from teacher_server.http_api.vllm.protocol import PromptLogprobsRequest
from teacher_server.http_api.vllm.serving import render_completions
from topk_protocol import SequenceArrays


class _Tokenizer:
    """A stand-in for a tokenizer's ``decode``: each id as ``tok<id>``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"tok{i}" for i in ids)


def _median_ms(fn: Callable[[], bytes], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def longest_wait_ms(fn: Callable[[], bytes], reps: int, tick: float = 0.0005) -> float:
    """The longest a thread that wakes every ``tick`` s (a probe's event loop) waited
    between two wake-ups while ``fn`` ran ``reps`` times in this one: how long the
    render held the interpreter's lock at a stretch."""
    stop = threading.Event()
    gaps: list[float] = []

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(tick)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.01)
    for _ in range(reps):
        fn()
    stop.set()
    thread.join()
    return max(gaps) * 1e3


def cases(positions: int) -> list[tuple[str, Callable[[], bytes], Callable[[], bytes]]]:
    """(route, reference render, vectorized render) of one sequence of ``positions``
    scored rows."""
    scored = payload(positions)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, scored.ids.max() + 1, positions + 1).astype(np.int32)
    # The prompt token inside the top K at about half the positions, as a model's is.
    inside = rng.random(positions) < 0.5
    column = rng.integers(0, K, positions)
    ids = scored.ids.copy()
    ids[inside, column[inside]] = tokens[1:][inside]
    scored = SequenceArrays(ids, scored.logprobs, scored.sampled_logprobs)
    generate = GenerateRequest([GenerateItem(tokens, True, 0, K, None, "bench")], False)
    ids_only = PromptLogprobsRequest([tokens], [None], K)
    echoed = PromptLogprobsRequest([tokens], [None], K, echo=True, decoded=True)
    texts = TokenTexts(_Tokenizer())
    texts.json_cells(np.unique(np.concatenate([tokens, ids.reshape(-1)])))  # warm

    return [
        (
            "SGLang /generate (input_top_logprobs)",
            lambda: reference.render_generate(generate, [scored], 0.25),
            lambda: render_generate(generate, [scored], 0.25),
        ),
        (
            "vLLM /v1/completions (prompt_logprobs)",
            lambda: reference.render_completions(ids_only, [scored], "m", None),
            lambda: render_completions(ids_only, [scored], "m", None),
        ),
        (
            "vLLM /v1/completions (prompt_logprobs, decoded_token)",
            lambda: reference.render_completions(echoed, [scored], "m", texts),
            lambda: render_completions(echoed, [scored], "m", texts),
        ),
    ]


def _same(old: bytes, new: bytes) -> bool:
    """The same JSON once every float is read as float32, laid out byte for byte alike
    apart from the floats' text (the completions' own ``id`` and ``created`` aside)."""
    a, b = json.loads(old), json.loads(new)
    for answer in (a, b):
        if isinstance(answer, dict):
            answer.pop("id", None)
            answer.pop("created", None)
    own = re.compile(rb'"cmpl-[0-9a-f]+"|"created": \d+')
    shapes = {reference.float_shape(own.sub(b"", body)) for body in (old, new)}
    return bool(reference.as_float32(a) == reference.as_float32(b)) and len(shapes) == 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=2047)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"{args.positions} positions, K = {K}, median of {args.reps}, rendered in one thread\n")
    print("| route | renderer | ms per sequence | bytes per position | longest probe wait, ms |")
    print("|---|---|---:|---:|---:|")
    for route, old, new in cases(args.positions):
        old_body, new_body = old(), new()
        if not _same(old_body, new_body):
            raise SystemExit(f"{route}: the two renderers' answers differ")
        for name, fn, body in (
            ("per-entry f-string", old, old_body),
            ("vectorized", new, new_body),
        ):
            ms = _median_ms(fn, args.reps)
            wait = longest_wait_ms(fn, args.reps)
            per_position = len(body) / args.positions
            print(f"| {route} | {name} | {ms:.1f} | {per_position:.0f} | {wait:.1f} |")


if __name__ == "__main__":
    main()
