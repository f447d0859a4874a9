"""The HTTP routes frameworks call their teacher with, against vLLM's OpenAI server, in
one run: throughput and bytes, a slime-style group's prefix reuse, probes under load.

Same tiny model and engine settings everywhere (float32, ``max_num_batched_tokens``
16384, 4096 tokens, vLLM's prefix cache on as both servers default to it). Every request
of a measurement has fresh random token ids (seeded by route, K and rep), so nothing is
read from a cache or shared between requests unless the measurement is about that.

1. **Throughput**, for each K (default 8 and 64), ``--batch`` x ``--seq-len`` (8 x 2048)
   tokens per rep, ``--reps`` reps after a warm-up; one request per sequence, all in
   flight at once (as the frameworks send them), every answer JSON-decoded and its rows
   counted as the client reads them:

   * this server's SGLang ``/generate`` (slime's body with ``top_logprobs_num`` K,
     miles' multi-teacher top-k mode), vLLM ``/v1/completions`` (``prompt_logprobs`` K,
     ``max_tokens`` 1, the body ``bench_teacher`` sends vLLM) and vLLM
     ``/inference/v1/generate`` (Prime-RL's body, ``prompt_logprobs`` K), and the gRPC
     ``ScoreStream`` (one request of all sequences, float16, decoded to numpy);
   * vLLM's OpenAI server (``--enable-scale-out`` for ``/inference/v1/generate``): the
     same ``/v1/completions`` and ``/inference/v1/generate`` bodies. SGLang's
     ``/generate`` has no twin there: its row is compared with vLLM's
     ``/v1/completions`` at the same K.

   Reported: answered positions per second (rows with a distribution, median over reps),
   bytes per answered position of the response bodies, and the ratio to vLLM's server.
   With ``--before DIR`` (another source tree of this project, e.g. a git worktree of an
   earlier commit) that tree's server is timed on the same work too, the two servers
   taking turns rep by rep with the one waiting suspended, and the table adds the ratio
   to it: the cost of a change, in one run.
2. **Prefix reuse through ``/generate``**: G = ``--group`` requests sent at once, slime's
   body (``logprob_start_len`` 0: every position), one per completion of one
   ``--prompt``-token prompt with ``--completion`` tokens each, against G distinct
   prompts of the same shapes; ``--group-rounds`` rounds, the two in alternating order.
   Reported: medians of the wall time of the G requests, their paired ratio, and the
   teacher's computed positions (``/metrics``).
3. **Probes under load**: ``--clients`` (64) client threads, each posting
   ``--probe-requests`` slime-style ``/generate`` requests of ``--seq-len`` tokens one
   after the other (slime's body, then again with ``top_logprobs_num`` 64:
   ``--probe-top``), while a separate process asks ``/healthz``, ``/readyz`` and gRPC
   health every 50 ms (:class:`devtools.probes.ProbeWatcher`). Reported: the slowest probe
   and the requests answered (the target: every probe within 1 s).

    python -m benchmarks.bench_http_routes [--model DIR] [--batch 8] [--seq-len 2048]
        [--k 8 64] [--reps 3] [--group 8] [--prompt 1536] [--completion 512]
        [--group-rounds 5] [--clients 64] [--probe-requests 2] [--probe-top 0 64]
        [--only throughput|group|probes] [--before DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

from benchmarks.bench_teacher import ROOT, _stop, _wait_http, model_or_tiny
from devtools.launch import TeacherProcess, free_port, start_teacher
from devtools.probes import ProbeWatcher
from topk_protocol import decode_sequence, encode_token_ids, pb, pb_grpc

VOCAB = 256  # byte tokens: inside every model's vocabulary here
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--max-num-batched-tokens", "16384"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}
MODEL_NAME = "tiny"
ROUTES = ["sglang", "completions", "token_generate"]
LABELS = {
    "sglang": "SGLang /generate (top_logprobs_num)",
    "completions": "vLLM /v1/completions (prompt_logprobs)",
    "token_generate": "vLLM /inference/v1/generate (prompt_logprobs)",
    "grpc": "gRPC ScoreStream (float16)",
}


def sequences(seed: tuple[int, ...], n: int, length: int) -> list[list[int]]:
    """``n`` x ``length`` random byte-token ids (seeded)."""
    rng = np.random.default_rng(list(seed))
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(n)]


def slime_body(tokens: list[int], top: int = 0) -> dict[str, Any]:
    """slime's teacher call (``slime/rollout/on_policy_distillation.py``, THUDM/slime);
    ``top`` > 0 adds ``top_logprobs_num`` (its multi-teacher top-k mode)."""
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top:
        body["top_logprobs_num"] = top
    return body


def completions_body(tokens: list[int], k: int) -> dict[str, Any]:
    """The ``/v1/completions`` body ``bench_teacher`` sends vLLM's server, at temperature
    1 (this teacher refuses another than the one it serves; vLLM's prompt log-probs do
    not depend on it)."""
    return {
        "model": MODEL_NAME,
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 1.0,
        "logprobs": k,
        "prompt_logprobs": k,
    }


def token_generate_body(tokens: list[int], k: int) -> dict[str, Any]:
    """Prime-RL's ``/inference/v1/generate`` body (``src/prime_rl/utils/client.py``) at K."""
    return {
        "model": MODEL_NAME,
        "token_ids": tokens,
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "prompt_logprobs": k,
        },
    }


def rows_in(route: str, answer: Any) -> int:
    """Rows with a distribution in a decoded answer, read as the route's clients read it."""
    if route == "sglang":
        top = answer["meta_info"].get("input_top_logprobs")
        entries = top if top is not None else answer["meta_info"]["input_token_logprobs"]
        return sum(1 for e in entries[1:] if e)
    if route == "completions":
        choice = answer["choices"][0]
        generated = len((choice.get("logprobs") or {}).get("top_logprobs") or [])
        return sum(1 for e in choice["prompt_logprobs"] if e) + generated
    return sum(1 for e in answer["prompt_logprobs"] if e)


PATHS = {
    "sglang": "/generate",
    "completions": "/v1/completions",
    "token_generate": "/inference/v1/generate",
}


def post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def body_for(route: str, tokens: list[int], k: int) -> dict[str, Any]:
    if route == "sglang":
        return slime_body(tokens, k)
    if route == "completions":
        return completions_body(tokens, k)
    return token_generate_body(tokens, k)


@dataclass
class Measured:
    seconds: float  # median over reps
    positions: int  # answered rows per rep
    nbytes: int  # response bytes per rep


#: One timed rep against one server: (seconds, answered positions, response bytes).
Rep = tuple[float, int, int]


class Turns:
    """Servers measured together take turns: while one is timed, the others are suspended
    (SIGSTOP, each with every process of its own): an idle vLLM engine still busy-waits
    for a while after a request, which would take the timed server's cores."""

    def __init__(self, servers: list[TeacherProcess]) -> None:
        self._processes = []
        for server in servers:
            root = psutil.Process(server.proc.pid)
            self._processes.append([root, *root.children(recursive=True)])

    def give(self, index: int) -> None:
        """Server ``index`` runs, every other one is suspended."""
        for i, processes in enumerate(self._processes):
            for p in processes:
                p.resume() if i == index else p.suspend()

    def all_run(self) -> None:
        for processes in self._processes:
            for p in processes:
                p.resume()


def _alternating(
    servers: list[Any], reps: int, one_rep: Any, turns: Turns | None = None
) -> list[Measured]:
    """``one_rep(server, rep)`` for each server, rep by rep after a warm-up rep 0, the
    servers' order alternating between reps (a paired comparison), each in its turn
    (``turns``: the others suspended); medians per server."""
    timed: list[list[Rep]] = [[] for _ in servers]
    for rep in range(reps + 1):
        order = list(range(len(servers)))
        for i in order if rep % 2 else order[::-1]:
            if turns is not None:
                turns.give(i)
            got = one_rep(servers[i], rep)
            if rep:
                timed[i].append(got)
    return [
        Measured(statistics.median(t for t, _, _ in reps_of), reps_of[-1][1], reps_of[-1][2])
        for reps_of in timed
    ]


def http_route(
    bases: list[str],
    route: str,
    k: int,
    reps: int,
    batch: int,
    length: int,
    turns: Turns | None = None,
) -> list[Measured]:
    """One route at K on each server: ``reps`` reps after a warm-up, ``batch`` requests in
    flight, the servers taking turns (:func:`_alternating`)."""

    def one(url: str, tokens: list[int]) -> tuple[int, int]:
        status, raw = post(url, body_for(route, tokens, k))
        if status != 200:
            raise RuntimeError(f"{route}: HTTP {status}: {raw[:300]!r}")
        return rows_in(route, json.loads(raw)), len(raw)

    with cf.ThreadPoolExecutor(batch) as pool:

        def one_rep(base: str, rep: int) -> Rep:
            seqs = sequences((ROUTES.index(route), k, rep), batch, length)
            t0 = time.perf_counter()
            got = list(pool.map(lambda s: one(base + PATHS[route], s), seqs))
            elapsed = time.perf_counter() - t0
            return elapsed, sum(g[0] for g in got), sum(g[1] for g in got)

        return _alternating(bases, reps, one_rep, turns)


def grpc_stream(
    targets: list[str], k: int, reps: int, batch: int, length: int, turns: Turns | None = None
) -> list[Measured]:
    """The gRPC ``ScoreStream`` at K on each server, as :func:`http_route` times a route."""
    opts = [("grpc.max_receive_message_length", 256 << 20)]
    channels = [grpc.insecure_channel(t, options=opts) for t in targets]

    def one_rep(ch: grpc.Channel, rep: int) -> Rep:
        stub = pb_grpc.TeacherStub(ch)
        req = pb.ScoreRequest(request_id="b", top_k=k, dtype=pb.LOGPROB_DTYPE_FLOAT16)
        for s in sequences((9, k, rep), batch, length):
            req.sequences.add(token_ids=encode_token_ids(np.asarray(s, np.int32)))
        t0 = time.perf_counter()
        positions = nbytes = 0
        for msg in stub.ScoreStream(iter([req]), timeout=600):
            nbytes += msg.ByteSize()
            positions += sum(decode_sequence(p).ids.shape[0] for p in msg.sequences)
        return time.perf_counter() - t0, positions, nbytes

    try:
        return _alternating(channels, reps, one_rep, turns)
    finally:
        for ch in channels:
            ch.close()


def computed_positions(server: TeacherProcess) -> float:
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.search(r"^topk_teacher_positions_computed_total ([0-9.e+]+)$", text, re.M)
    if found is None:
        raise RuntimeError("topk_teacher_positions_computed_total is not on /metrics")
    return float(found.group(1))


def group_reuse(server: TeacherProcess, a: argparse.Namespace) -> dict[str, list[float]]:
    """G slime-style requests of one prompt vs G distinct prompts; per variant per round:
    wall seconds and positions computed."""
    url = server.http + "/generate"
    out: dict[str, list[float]] = {"group s": [], "distinct s": [], "group computed": [],
                                   "distinct computed": []}  # fmt: skip
    rng = np.random.default_rng(1234)

    def send(seqs: list[list[int]]) -> None:
        with cf.ThreadPoolExecutor(len(seqs)) as pool:
            for status, raw in pool.map(lambda s: post(url, slime_body(s)), seqs):
                if status != 200:
                    raise RuntimeError(f"/generate: HTTP {status}: {raw[:300]!r}")
                answer = json.loads(raw)
                if len(answer["meta_info"]["input_token_logprobs"]) != a.prompt + a.completion:
                    raise RuntimeError("/generate: wrong number of entries")

    def group() -> list[list[int]]:
        head = rng.integers(0, VOCAB, a.prompt).tolist()
        return [head + rng.integers(0, VOCAB, a.completion).tolist() for _ in range(a.group)]

    def distinct() -> list[list[int]]:
        return [rng.integers(0, VOCAB, a.prompt + a.completion).tolist() for _ in range(a.group)]

    send(group())  # warm-up
    for r in range(a.group_rounds + 1):
        order = [("group", group), ("distinct", distinct)]
        for name, make in order if r % 2 else order[::-1]:
            seqs = make()
            before = computed_positions(server)
            t0 = time.perf_counter()
            send(seqs)
            if r:
                out[f"{name} s"].append(time.perf_counter() - t0)
                out[f"{name} computed"].append(computed_positions(server) - before)
    return out


def probes_under_load(server: TeacherProcess, a: argparse.Namespace) -> tuple[float, str]:
    """The slowest probe while ``a.clients`` clients post ``/generate`` requests."""
    url = server.http + "/generate"
    answered, refused = [0], [0]

    def client(i: int) -> None:
        for j in range(a.probe_requests):
            (seq,) = sequences((7, i, j), 1, a.seq_len)
            status, raw = post(url, slime_body(seq, a.probe_top))
            if status == 200 and len(json.loads(raw)["meta_info"]["input_token_logprobs"]):
                answered[0] += 1
            else:
                refused[0] += 1

    with ProbeWatcher(server.http, server.target) as probes:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(client, range(a.clients)))
        wall = time.perf_counter() - t0
    detail = (
        f"{answered[0]} requests answered, {refused[0]} refused, in {wall:.1f} s; "
        f"{probes.summary()}"
    )
    return probes.max_s(), detail


def start_vllm_server(model: str, k: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS,
        "--max-logprobs", str(k), "--served-model-name", MODEL_NAME, "--enable-scale-out",
    ]  # fmt: skip
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", proc)
    return proc, base


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a fresh tiny random Qwen2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--k", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--group-rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--probe-requests", type=int, default=2)
    ap.add_argument(
        "--probe-top", type=int, nargs="+", default=[0, 64],
        help="top_logprobs_num of the loading requests, one load per value (0: slime's body)",
    )  # fmt: skip
    ap.add_argument("--only", choices=["throughput", "group", "probes"], help="one part only")
    ap.add_argument(
        "--before", metavar="DIR",
        help="a source tree of this project (e.g. a git worktree of an earlier commit): its "
        "teacher server is started too and timed on the same throughput work, the two "
        "servers taking turns rep by rep (the one waiting suspended); the table adds a "
        "'vs before' column",
    )  # fmt: skip
    return ap


def throughput_table(
    ours: dict[tuple[str, int], Measured],
    theirs: dict[tuple[str, int], Measured],
    ks: list[int],
    before: dict[tuple[str, int], Measured] | None = None,
) -> None:
    if before:
        print("| K | server | route | answered positions/s | bytes/position | vs before | "
              "vs vLLM's server |")  # fmt: skip
        print("|---|---|---|---:|---:|---:|---:|")
        for k in ks:
            for route in [*ROUTES, "grpc"]:
                m, b = ours[(route, k)], before[(route, k)]
                for name, got in (("topk-distill, before", b), ("topk-distill", m)):
                    speed = got.positions / got.seconds
                    twin = theirs[(route if route in ROUTES[1:] else "completions", k)]
                    ratio = speed / (twin.positions / twin.seconds)
                    vs = speed / (b.positions / b.seconds)
                    print(
                        f"| {k} | {name} | {LABELS[route]} | {speed:,.0f} | "
                        f"{got.nbytes / got.positions:,.0f} | {vs:.2f}x | {ratio:.1f}x |"
                    )
        print()
    print("| K | server | route | answered positions/s | bytes/position | vs vLLM's server |")
    print("|---|---|---|---:|---:|---:|")
    for k in ks:
        for (server, route), m in [
            *((("vLLM OpenAI server", r), theirs[(r, k)]) for r in ROUTES[1:]),
            *((("topk-distill", r), ours[(r, k)]) for r in [*ROUTES, "grpc"]),
        ]:
            speed = m.positions / m.seconds
            twin = theirs[(route if route in ROUTES[1:] else "completions", k)]
            ratio = speed / (twin.positions / twin.seconds)
            print(
                f"| {k} | {server} | {LABELS[route]} | {speed:,.0f} | "
                f"{m.nbytes / m.positions:,.0f} | {ratio:.1f}x |"
            )


def main() -> None:
    a = build_parser().parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-routes-"))
    model = model_or_tiny(a.model, tmp)
    print(f"# {a.batch} x {a.seq_len} tokens, K {a.k}, reps={a.reps}, logs in {tmp}", flush=True)
    teacher_args = ["--backend", "vllm", "--model", model, *ENGINE_ARGS,
                    "--max-top-k", str(max(a.k)), "--served-model-name", MODEL_NAME]  # fmt: skip
    server = start_teacher(teacher_args, tmp / "teacher.log", env=ENV)
    ours: dict[tuple[str, int], Measured] = {}
    before: dict[tuple[str, int], Measured] = {}
    try:
        if a.only in (None, "throughput"):
            servers = [server]
            if a.before:
                log = tmp / "teacher-before.log"
                env = {**ENV, "PYTHONPATH": str(Path(a.before).resolve())}
                servers.append(start_teacher(teacher_args, log, env=env, cwd=tmp))
            turns = Turns(servers) if len(servers) > 1 else None
            try:
                for k in a.k:
                    for route in ROUTES:
                        bases = [s.http for s in servers]
                        got = http_route(bases, route, k, a.reps, a.batch, a.seq_len, turns)
                        ours[(route, k)], before[(route, k)] = got[0], got[-1]
                    targets = [s.target for s in servers]
                    got = grpc_stream(targets, k, a.reps, a.batch, a.seq_len, turns)
                    ours[("grpc", k)], before[("grpc", k)] = got[0], got[-1]
                    print(f"# ours, K = {k}: done", flush=True)
            finally:
                if turns is not None:
                    turns.all_run()
                for extra in servers[1:]:
                    extra.stop()
        if a.only in (None, "group"):
            g = group_reuse(server, a)
            ratios = [d / s for d, s in zip(g["distinct s"], g["group s"], strict=True)]
            print()
            print(f"G = {a.group} requests of {a.prompt} + {a.completion} tokens via /generate:")
            print("| requests | teacher s (median) | positions computed (median) |")
            print("|---|---:|---:|")
            for name, label in (("group", "one prompt, G completions"), ("distinct", "G prompts")):
                print(
                    f"| {label} | {statistics.median(g[f'{name} s']):.2f} | "
                    f"{statistics.median(g[f'{name} computed']):,.0f} |"
                )
            print(f"paired ratio distinct / group: median {statistics.median(ratios):.2f}x "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)  # fmt: skip
        if a.only in (None, "probes"):
            print()
            print(f"probes under {a.clients} clients posting {a.seq_len}-token /generate:")
            print("| top_logprobs_num | slowest probe, ms | detail |")
            print("|---:|---:|---|")
            for top in a.probe_top:
                worst, detail = probes_under_load(
                    server, argparse.Namespace(**{**vars(a), "probe_top": top})
                )
                print(f"| {top} | {worst * 1e3:.0f} | {detail} |", flush=True)
    finally:
        server.stop()
    if a.only not in (None, "throughput"):
        return
    theirs: dict[tuple[str, int], Measured] = {}
    proc, base = start_vllm_server(model, max(a.k), tmp / "vllm.log")
    try:
        for k in a.k:
            for route in ROUTES[1:]:
                theirs[(route, k)] = http_route([base], route, k, a.reps, a.batch, a.seq_len)[0]
            print(f"# vLLM's server, K = {k}: done", flush=True)
    finally:
        _stop(proc)
    print()
    throughput_table(ours, theirs, a.k, before if a.before else None)


if __name__ == "__main__":
    main()
