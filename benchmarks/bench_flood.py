"""One client's flood against the others and the probes.

One vLLM teacher on the tiny model (CPU, float32). Three loads, each measured with a
canary client (one ``Score`` of one 16-token sequence at K = 16 every ``--canary-s``,
0.5 s) and probes (``/healthz``, ``/readyz`` and gRPC health every 50 ms from a separate
process, :class:`devtools.probes.ProbeWatcher`):

1. the canary alone for ``--alone-s`` (the baseline);
2. one client sending ``--requests`` (100,000) one-token requests down one
   ``ScoreStream`` as fast as it can;
3. four such streams at once, ``--requests`` / 4 each.

The flood runs in a process of its own (its client's GIL is not the canary's; with
``--flood-nice 19`` it takes only CPU the server leaves, as a client on another machine
would); it checks that every request id was answered once, without error, and counts the
answers that came ahead of an earlier request's (the protocol allows any order; the
client reorders).
Reported per load: the flood's wall time and positions/s (flood + canary), the canary's
latency quantiles against its own alone, the probes (slowest of each kind, how many HTTP
probes took over 1 s), the server tree's RSS before and after. With ``--baseline-src
DIR`` the same runs go first against the server of another checkout (e.g. the version
before a change: ``git worktree add --detach DIR <commit>``), and the table compares the
two (positions/s target: within 10%). The CPU is named in the output (model, AVX-512 /
AMX bf16 present or not), and the load average at the start and end of each server's
runs.

    python -m benchmarks.bench_flood [--requests 100000] [--baseline-src DIR]
        [--server-args "--admission-order arrival"] [--streams 1,4] [--flood-nice 19]
        [--variant NAME="--max-inflight-requests 32" ...]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

from benchmarks.soak import tree_rss
from devtools.launch import TeacherProcess, start_teacher
from devtools.probes import ProbeWatcher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from topk_protocol import build_request, pb_grpc

MIB = 1024 * 1024
#: An orchestrator's usual probe timeout.
PROBE_LIMIT_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100_000, help="flood requests in all")
    ap.add_argument("--canary-s", type=float, default=0.5)
    ap.add_argument(
        "--flood-nice",
        type=int,
        default=0,
        help="run the flood's client at this nice (a load generator sharing the server's cores)",
    )
    ap.add_argument("--alone-s", type=float, default=30.0)
    ap.add_argument("--baseline-src", default="", help="another checkout's server first")
    ap.add_argument("--server-args", default="", help="extra serve flags (this tree only)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run this tree with these extra serve flags, named NAME (repeatable)",
    )
    ap.add_argument(
        "--streams",
        default="1,4",
        help="the floods to run: comma-separated numbers of streams (default 1,4)",
    )
    ap.add_argument(
        "--profile-s",
        type=float,
        default=0.0,
        help="py-spy every process of the server for this long during the 1-stream flood",
    )
    return ap


def cpu_description() -> str:
    """The CPU's model name and whether it has AVX-512 BF16 / AMX bf16 (``/proc/cpuinfo``)."""
    model, flags = "unknown CPU", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    has = {name: name in flags for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}
    listed = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in has.items())
    native = has["avx512_bf16"] or has["amx_bf16"]
    return f"{model} ({os.cpu_count()} CPUs; {listed}: bf16 {'native' if native else 'emulated'})"


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# -- the flood (its own process) ------------------------------------------------------------
def _one_stream(target: str, first: int, n: int, out: dict[str, Any]) -> None:
    def requests() -> Any:
        for i in range(first, first + n):
            req = build_request([np.array([i % 512], np.int32)], 1, dtype="float16")
            req.request_id = str(i)
            yield req

    answered: set[int] = set()
    errors, ahead, lowest = 0, 0, first  # ahead: answers before an earlier request's
    with grpc.insecure_channel(target) as ch:
        try:
            for msg in pb_grpc.TeacherStub(ch).ScoreStream(requests(), timeout=7200):
                if msg.HasField("error"):
                    errors += 1
                if msg.final:
                    rid = int(msg.request_id)
                    ahead += rid != lowest
                    answered.add(rid)
                    while lowest in answered:
                        lowest += 1
        except grpc.RpcError as e:
            out["rpc_error"] = f"{e.code().name}: {e.details()}"
    every = answered == set(range(first, first + n))
    out.update(answered=len(answered), errors=errors, every_id=every, ahead=ahead)


def _flood(target: str, streams: int, per_stream: int, conn: Any, nice: int = 0) -> None:
    os.nice(nice)
    results: list[dict[str, Any]] = [{} for _ in range(streams)]
    threads = [
        threading.Thread(target=_one_stream, args=(target, s * per_stream, per_stream, r))
        for s, r in enumerate(results)
    ]
    conn.recv()  # go
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send((time.perf_counter() - t0, results))


# -- one server's runs ----------------------------------------------------------------------
@dataclass
class Row:
    server: str
    load: str
    wall_s: float = 0.0
    positions: int = 0
    canary_ms: list[float] = field(default_factory=list)
    probes: ProbeWatcher | None = None
    flood_ok: str = "-"
    rss_mib: tuple[float, float] = (0.0, 0.0)
    cpu_s: dict[str, float] = field(default_factory=dict)
    requests: int = 0

    @property
    def positions_per_s(self) -> float:
        return self.positions / self.wall_s if self.wall_s else 0.0


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server process and each of its
    descendants, by process name (``server``, ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    out: dict[str, float] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            name = "server" if proc.pid == pid else proc.name()
            out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def start_py_spy(
    pid: int, seconds: float, out_dir: Path
) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    """``py-spy record`` (collapsed stacks) of the server and each of its descendants."""
    out_dir.mkdir(parents=True, exist_ok=True)
    root = psutil.Process(pid)
    spies = []
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    for proc in [root, *root.children(recursive=True)]:
        name = "server" if proc.pid == pid else proc.name()
        out = out_dir / f"{name.replace(':', '_')}-{proc.pid}.txt"
        cmd = [py_spy, "record", "-p", str(proc.pid), "-d", str(int(seconds)), "-r", "50"]
        cmd += ["-f", "raw", "-o", str(out), "--nonblocking"]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        spies.append((name, spy, out))
    return spies


def top_frames(path: Path, n: int = 6) -> str:
    """The ``n`` innermost frames with the most samples in a collapsed-stack file."""
    leaf: dict[str, int] = {}
    total = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                frame = stack.split(";")[-1]
                leaf[frame] = leaf.get(frame, 0) + int(count)
                total += int(count)
    best = sorted(leaf.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{k} {v / total:.0%}" for k, v in best) if total else "no samples"


def canary_call(stub: pb_grpc.TeacherStub, rng: np.random.Generator) -> float:
    req = build_request([rng.integers(0, 512, 16).astype(np.int32)], 16, dtype="float32")
    t0 = time.perf_counter()
    resp = stub.Score(req, timeout=120)
    took = time.perf_counter() - t0
    if len(resp.sequences) != 1:
        raise RuntimeError("canary: wrong answer")
    return took


def run_load(
    server: TeacherProcess, name: str, label: str, streams: int, per_stream: int, args: Any
) -> Row:
    """The canary (and the flood of ``streams`` x ``per_stream``, when > 0) with probes."""
    row = Row(name, label)
    rng = np.random.default_rng(0)
    rss0 = sum(tree_rss(server.proc.pid)) / MIB
    cpu0 = tree_cpu(server.proc.pid)
    with (
        grpc.insecure_channel(server.target) as ch,
        ProbeWatcher(server.http, server.target, timeout_s=30) as probes,
    ):
        stub = pb_grpc.TeacherStub(ch)
        spies: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        if streams == 1 and args.profile_s > 0:
            spies = start_py_spy(server.proc.pid, args.profile_s, Path(args.tmp) / name)
        if streams:
            ctx = multiprocessing.get_context("spawn")
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_flood, args=(server.target, streams, per_stream, theirs, args.flood_nice)
            )
            proc.start()
            mine.send("go")
            done = lambda: mine.poll() or not proc.is_alive()  # noqa: E731
        else:
            t_end = time.perf_counter() + args.alone_s
            done = lambda: time.perf_counter() >= t_end  # noqa: E731
        t0 = time.perf_counter()
        while not done():
            t_call = time.perf_counter()
            row.canary_ms.append(canary_call(stub, rng) * 1e3)
            time.sleep(max(args.canary_s - (time.perf_counter() - t_call), 0))
        row.wall_s = time.perf_counter() - t0
        row.positions = 16 * len(row.canary_ms)
        if streams:
            row.wall_s, results = mine.recv()
            proc.join(60)
            answered = sum(r.get("answered", 0) for r in results)
            errors = sum(r.get("errors", 0) for r in results)
            every = all(r.get("every_id") for r in results)
            ahead = sum(r.get("ahead", 0) for r in results)
            rpc = [r["rpc_error"] for r in results if "rpc_error" in r]
            row.positions += answered
            order = "in order" if not ahead else f"{ahead:,} ahead of an earlier one"
            row.flood_ok = (
                f"{answered:,}/{streams * per_stream:,} answered "
                f"({'each id once' if every else 'IDS MISSING'}), {order}, {errors} errors"
                + (f", {rpc[0]}" if rpc else "")
            )
    for proc_name, spy, out in spies:
        spy.wait(60)
        print(f"  py-spy, {proc_name} (samples where it was not idle): {top_frames(out)}")
    row.probes = probes
    row.rss_mib = (rss0, sum(tree_rss(server.proc.pid)) / MIB)
    row.cpu_s = {k: v - cpu0.get(k, 0.0) for k, v in tree_cpu(server.proc.pid).items()}
    row.requests = len(row.canary_ms) + (row.positions - 16 * len(row.canary_ms))
    print(f"  {name} / {label}: {row.wall_s:.1f} s, {probes.summary()}", flush=True)
    return row


def run_server(
    name: str, model: Path, tmp: Path, args: Any, src: str = "", extra: str = ""
) -> list[Row]:
    env = {"PYTHONPATH": src} if src else None
    print(f"{name}: load average {load_average()} at the start", flush=True)
    server = start_teacher(
        ["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS, *shlex.split(extra)],
        tmp / f"{name}.log",
        env=env,
        cwd=src or None,
    )
    try:
        rows = [run_load(server, name, "canary alone", 0, 0, args)]
        for n in (int(x) for x in args.streams.split(",")):
            per = args.requests // n
            label = f"{n} stream{'s' if n > 1 else ''} x {per:,}"
            rows.append(run_load(server, name, label, n, per, args))
    finally:
        server.stop()
    print(f"{name}: load average {load_average()} at the end", flush=True)
    return rows


def quantile(v: list[float], q: float) -> float:
    return float(np.quantile(v, q)) if v else float("nan")


def report(rows: list[Row]) -> None:
    print(
        "\n| server | load | wall s | positions/s | flood | canary p50 / p99 / max, ms | "
        "p99 vs alone (target <= 3x) | slowest /healthz, /readyz, gRPC health, ms | "
        f"HTTP probes over {PROBE_LIMIT_S:g} s | tree RSS before -> after, MiB |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    alone: dict[str, float] = {}
    for r in rows:
        c = r.canary_ms
        p99 = quantile(c, 0.99)
        if r.load == "canary alone":
            alone[r.server] = p99
        lat = r.probes.latencies_s if r.probes else {}
        slow = ", ".join(
            f"{max(lat.get(k, [0])) * 1e3:.0f}" for k in ("healthz", "readyz", "grpc_health")
        )
        late = r.probes.late(PROBE_LIMIT_S) if r.probes else 0
        n_http = len(lat.get("healthz", [])) + len(lat.get("readyz", []))
        print(
            f"| {r.server} | {r.load} | {r.wall_s:.1f} | {r.positions_per_s:,.0f} | {r.flood_ok} | "
            f"{quantile(c, 0.5):.0f} / {p99:.0f} / {max(c, default=float('nan')):.0f} | "
            f"{p99 / alone[r.server]:.2f}x | {slow} | {late} of {n_http} | "
            f"{r.rss_mib[0]:.0f} -> {r.rss_mib[1]:.0f} |"
        )
    print(
        "\nCPU per request (canary + flood requests), ms, by process; and each process's "
        "share of one core over the load:"
    )
    for r in rows:
        per = ", ".join(
            f"{k} {v / r.requests * 1e3:.2f} ({v / r.wall_s:.0%})"
            for k, v in sorted(r.cpu_s.items())
            if r.requests and r.wall_s
        )
        print(f"- {r.server} / {r.load} ({r.requests:,} requests): {per}")
    servers = list(dict.fromkeys(r.server for r in rows))
    base = {r.load: r for r in rows if r.server == servers[0]}
    for other in servers[1:]:
        for r in rows:
            if r.server != other or not r.positions or r.load == "canary alone":
                continue
            if r.load in base and base[r.load].positions_per_s:
                ratio = r.positions_per_s / base[r.load].positions_per_s
                print(
                    f"{r.load}: {other} {r.positions_per_s:,.0f} positions/s against "
                    f"{servers[0]} {base[r.load].positions_per_s:,.0f}: {ratio:.2f}x "
                    "(target: within 10%)"
                )


def main() -> None:
    args = build_parser().parse_args()
    print("CPU:", cpu_description(), flush=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        args.tmp = tmp_dir
        model = write_tiny_model(tmp / "model", seed=0)
        rows: list[Row] = []
        if args.baseline_src:
            src = str(Path(args.baseline_src).resolve())
            rows += run_server("baseline", model, tmp, args, src=src)
        rows += run_server("this tree", model, tmp, args, extra=args.server_args)
        for variant in args.variant:
            name, _, flags = variant.partition("=")
            rows += run_server(name, model, tmp, args, extra=f"{args.server_args} {flags}")
    report(rows)


if __name__ == "__main__":
    main()
