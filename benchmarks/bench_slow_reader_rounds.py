"""Slow readers, killed, round after round: does the teacher's memory come back?

One vLLM teacher on the tiny model (CPU, float32). A canary client scores one small
request after another all along (so the server is never idle: its idle-time cleanups do
not run). Each of ``--rounds`` (10) rounds: two client processes each open a
``ScoreStream`` and send ``--requests`` (200) requests of 8 x ``--length`` (512) tokens at
K = 64, float32 (about 1.5 MiB of answer each); one reads a message every 3 s, the other
never reads; after ``--round-s`` (60) both are SIGKILLed; the RSS of the server's process
tree is read at the kill and ``--settle`` seconds after it (5, 15, 30).

Printed per round: the RSS of the server process, vLLM's engine-core and worker
processes and the tree, at the kill and after each settle time; the rows the server keeps
to share (``topk_teacher_shared_rows_bytes``), the in-flight and queued gauges; the
canary's p50 and slowest call; the probes (``/healthz``, ``/readyz``, gRPC health, every
0.5 s from a process of their own: :class:`devtools.probes.ProbeWatcher`) asked during
the round, the slowest and how many took over 1 s. Then the tree's RSS at the last
settle time against the baseline (before the first round), per round, and its
least-squares slope over the rounds (MiB per round).

    python -m benchmarks.bench_slow_reader_rounds [--rounds 10] [--round-s 60]
        [--settle 5,15,30] [--server-args "..."]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import psutil

from devtools.launch import TeacherProcess, start_teacher
from devtools.probes import ProbeWatcher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from teacher_server.process_memory import process_label, resident_bytes
from topk_protocol import build_request, pb_grpc

MIB = 1024 * 1024
K = 64

#: One slow client (a subprocess, so that SIGKILL is a real client's death): ARGV target,
#: seed, requests, length, read interval in s (0: never read).
_CLIENT = """
import sys, time
import grpc, numpy as np
from topk_protocol import build_request, pb_grpc
target, seed, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
every = float(sys.argv[5])
def requests():
    rng = np.random.default_rng(seed)
    for i in range(n):
        seqs = [rng.integers(0, 512, length).astype(np.int32) for _ in range(8)]
        yield build_request(seqs, 64, dtype="float32")
channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
call = pb_grpc.TeacherStub(channel).ScoreStream(requests())
if every > 0:
    for _ in call:
        time.sleep(every)
while True:
    time.sleep(60)
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--round-s", type=float, default=60.0, help="slow clients' life")
    ap.add_argument("--settle", default="5,15,30", help="seconds after the kill to read RSS")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--read-every-s", type=float, default=3.0)
    ap.add_argument("--server-args", default="", help="extra teacher-server serve flags")
    ap.add_argument("--target-mib", type=float, default=64.0)
    ap.add_argument(
        "--canary-pause-s",
        type=float,
        default=0.0,
        help="pause the canary for this long after each kill (the server goes idle)",
    )
    ap.add_argument(
        "--gdb-trim",
        action="store_true",
        help="diagnosis (needs gdb and ptrace rights): after the last round, call "
        "malloc_trim(0) in vLLM's engine-core and worker processes and print the RSS again",
    )
    return ap


def gdb_trim(pid: int) -> None:
    """Call glibc's ``malloc_trim(0)`` in every vLLM process under ``pid`` through gdb."""
    for child in psutil.Process(pid).children(recursive=True):
        if _kind(child, pid) != "other":
            subprocess.run(
                ["gdb", "-p", str(child.pid), "-batch", "-ex", "call (int) malloc_trim(0)"],
                capture_output=True,
                timeout=120,
                check=False,
            )


#: ``process_memory.process_label``'s names of vLLM's processes -> this table's columns.
_COLUMNS = {"engine_core": "EngineCore", "worker": "Worker"}


def _kind(proc: psutil.Process, root: int) -> str:
    """``EngineCore`` or ``Worker`` (by vLLM's process titles, as ``/metrics`` names
    them), else ``other``."""
    return _COLUMNS.get(process_label(proc.pid, root), "other")


def largest_anonymous_mapping(pid: int) -> tuple[float, float]:
    """(size, resident) in MiB of the process's largest anonymous mapping: in vLLM's
    worker, the KV cache (one tensor of the engine's KV cache size, its pages resident
    once first written)."""
    best = (0.0, 0.0)
    size = 0.0
    anonymous = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            anonymous = len(fields) < 6
        elif fields[:1] == ["Size:"]:
            size = int(fields[1]) / 1024
        elif fields[:1] == ["Rss:"] and anonymous and size > best[0]:
            best = (size, int(fields[1]) / 1024)
    return best


def resident_kinds(pid: int) -> dict[str, float]:
    """Resident MiB of a process by kind: ``anon``, ``file``, ``shm`` (the split
    ``/metrics`` exports, :func:`teacher_server.process_memory.resident_bytes`: shared
    memory is counted in each process that maps it) and ``pss`` (``smaps_rollup``: every
    shared page divided among the processes that map it, so a sum counts it once)."""
    kinds = resident_bytes(pid)
    labels = {"anon": "anonymous", "file": "file", "shm": "shared"}
    out = {short: kinds.get(label, 0) / MIB for short, label in labels.items()}
    out["pss"] = 0.0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["pss"] = int(line.split()[1]) / 1024
    return out


def tree_rss(pid: int) -> dict[str, float]:
    """RSS in MiB of the server process, vLLM's engine-core and worker processes, the
    tree (every descendant included); ``<kind>_anon`` / ``_file`` / ``_shm`` split each of
    the three (:func:`resident_kinds`); ``tree_pss`` the tree with shared pages once."""
    root = psutil.Process(pid)
    out = {"server": root.memory_info().rss / MIB, "EngineCore": 0.0, "Worker": 0.0}
    kinds = resident_kinds(pid)
    out.update({f"server_{k}": v for k, v in kinds.items()})
    total, pss = out["server"], kinds["pss"]
    for child in root.children(recursive=True):
        try:
            rss = child.memory_info().rss / MIB
            kinds = resident_kinds(child.pid)
        except (psutil.Error, OSError):
            continue
        total += rss
        pss += kinds["pss"]
        kind = _kind(child, pid)
        if kind in out:
            out[kind] += rss
            for k, v in kinds.items():
                out[f"{kind}_{k}"] = out.get(f"{kind}_{k}", 0.0) + v
        if kind == "Worker":
            out["kv_size"], out["kv_resident"] = largest_anonymous_mapping(child.pid)
    out["tree"], out["tree_pss"] = total, pss
    return out


def gauges(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()

    def one(name: str) -> float:
        found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(found.group(1)) if found else float("nan")

    return {
        "shared_rows_mib": one("topk_teacher_shared_rows_bytes") / MIB,
        "in_flight": one("topk_teacher_requests_in_flight"),
        "queued": one("topk_teacher_requests_queued"),
    }


class Canary:
    """One small request after another (1 x 64 tokens, K = 8) for the whole run."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._stop = threading.Event()
        self._resume_at = 0.0
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def pause(self, seconds: float) -> None:
        """No new call for ``seconds`` from now."""
        self._resume_at = time.monotonic() + seconds

    def take(self) -> list[float]:
        """The latencies (s) since the last call."""
        with self._lock:
            out, self._latencies = self._latencies, []
        return out

    def _run(self) -> None:
        rng = np.random.default_rng(7)
        with grpc.insecure_channel(self._target) as ch:
            stub = pb_grpc.TeacherStub(ch)
            while not self._stop.is_set():
                if time.monotonic() < self._resume_at:
                    time.sleep(0.05)
                    continue
                seq = rng.integers(0, 512, 64).astype(np.int32)
                t0 = time.perf_counter()
                stub.Score(build_request([seq], 8, dtype="float32"), timeout=120)
                with self._lock:
                    self._latencies.append(time.perf_counter() - t0)


def _slow_clients(server: TeacherProcess, a: argparse.Namespace, r: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CLIENT,
                server.target,
                str(1000 * r + i),
                str(a.requests),
                str(a.length),
                str(every),
            ],
            env=env,
        )
        for i, every in enumerate((a.read_every_s, 0.0))
    ]


def _split(rss: dict[str, float], kind: str) -> str:
    """``total (anonymous + file + shared memory)`` MiB of one process kind."""
    parts = (rss.get(f"{kind}_{k}", 0.0) for k in ("anon", "file", "shm"))
    return f"{rss[kind]:,.0f} ({' + '.join(f'{v:,.0f}' for v in parts)})"


def _row(label: str, rss: dict[str, float], g: dict[str, float], base: dict[str, float]) -> str:
    return (
        f"| {label} | {_split(rss, 'server')} | {_split(rss, 'EngineCore')} "
        f"| {_split(rss, 'Worker')} "
        f"| {rss.get('kv_resident', 0):,.0f} of {rss.get('kv_size', 0):,.0f} "
        f"| {rss['tree']:,.0f} ({rss['tree'] - base['tree']:+,.0f}) "
        f"| {rss['tree_pss']:,.0f} ({rss['tree_pss'] - base['tree_pss']:+,.0f}) | "
        f"{g['shared_rows_mib']:.1f} | {g['in_flight']:.0f} / {g['queued']:.0f} |"
    )


def _summary(name: str, after: list[float], base: float, settle: float, target: float) -> str:
    """One line: ``after`` (MiB, one per round) against ``base``, and their slope."""
    over = [t - base for t in after]
    slope = float(np.polyfit(np.arange(1, len(after) + 1), after, 1)[0]) if len(after) > 1 else 0.0
    return (
        f"{name} {settle:g} s after each kill vs the baseline ({base:,.0f} MiB): "
        f"{', '.join(f'{d:+.0f}' for d in over)} MiB; worst {max(over):+.0f} "
        f"(target within {target:g}); slope over the rounds {slope:+.2f} MiB/round"
    )


def main() -> None:
    a = build_parser().parse_args()
    settle = [float(s) for s in a.settle.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", seed=0)
        args = ["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS]
        server = start_teacher([*args, *shlex.split(a.server_args)], Path(tmp) / "server.log")
        try:
            with Canary(server.target) as canary:
                time.sleep(5)
                base = tree_rss(server.proc.pid)
                print("| when | server MiB (anonymous + file + shared memory) | EngineCore "
                      "| Worker | Worker's largest anonymous mapping (KV cache), resident of "
                      "size | tree RSS (vs baseline) | tree PSS (vs baseline) | "
                      "shared rows MiB | in flight / queued |")  # fmt: skip
                print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
                print(_row("baseline", base, gauges(server.http), base), flush=True)
                after: list[dict[str, float]] = []
                canary_rows = []
                for r in range(1, a.rounds + 1):
                    canary.take()
                    with ProbeWatcher(server.http, server.target, interval_s=0.5) as probes:
                        clients = _slow_clients(server, a, r)
                        time.sleep(a.round_s)
                        rss = tree_rss(server.proc.pid)
                        for c in clients:
                            c.send_signal(signal.SIGKILL)
                            c.wait()
                        canary.pause(a.canary_pause_s)
                        print(_row(f"round {r}, at the kill", rss, gauges(server.http), base))
                        t_kill = time.monotonic()
                        for s in settle:
                            time.sleep(max(0.0, t_kill + s - time.monotonic()))
                            rss = tree_rss(server.proc.pid)
                            g = gauges(server.http)
                            print(_row(f"round {r}, kill + {s:g} s", rss, g, base))
                    after.append(rss)
                    lat = canary.take()
                    canary_rows.append(
                        (r, np.median(lat) * 1e3, max(lat), len(lat), probes.count(),
                         probes.max_s() * 1e3, probes.late(1.0))
                    )  # fmt: skip
                    sys.stdout.flush()
                if a.gdb_trim:
                    gdb_trim(server.proc.pid)
                    rss = tree_rss(server.proc.pid)
                    print(
                        _row("malloc_trim(0) in vLLM's processes", rss, gauges(server.http), base)
                    )
            print()
            print("| round | canary calls | p50 ms | slowest s | probes | slowest probe ms "
                  "| probes over 1 s |")  # fmt: skip
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for r, p50, worst, n, n_probes, probe_ms, late in canary_rows:
                print(
                    f"| {r} | {n} | {p50:.1f} | {worst:.2f} | {n_probes} | {probe_ms:.0f} "
                    f"| {late} |"
                )
            print()
            for key, name in (("tree", "tree RSS"), ("tree_pss", "tree PSS")):
                print(_summary(name, [r[key] for r in after], base[key], settle[-1], a.target_mib))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
