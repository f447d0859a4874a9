"""Soak: does the teacher's memory creep under steady load, and come back after a storm?

One vLLM teacher on the tiny model (CPU). ``--clients`` (4) threads send a mix of
``Score`` and ``ScoreStream`` requests with K from 1 to 64 and all three dtypes, checking
every answer's size. Every ``--sample-s`` (10) the RSS of the server process and of its
descendants (vLLM's engine-core and worker processes, also by kind of mapping) is
sampled, with what the server's memory trim (``--memory-trim-idle-s``: only when idle,
so not under this load) gave back so far (``/metrics``).

Before the load, ``--largest-rounds`` (3) times, every client sends its largest request
at once (4 x 256 tokens at K = 64, float32): the largest engine batch the load can make,
so that glibc's heap in vLLM's processes reaches the high-water mark of that batch before
anything is measured (a heap grows to the largest batch it has served and keeps that
size; without this the fit sees a step each time the random load first lines up a larger
batch than any before).

Soak (default): for ``--minutes`` (10); reported: the RSS slope in MiB/min after
``--warmup-min`` (2) and over the last ``--slope-last-min`` (10) minutes by a
least-squares fit, per process and for the whole tree, against the target of 2 MiB/min;
the requests served, errors (a wrong answer size counts as one) and the probes
(``/healthz``, ``/readyz`` and gRPC health every ``--probe-s``, 0.25 s, from a separate
process): the slowest and how many took over 1 s.

Storm (``--storm``): after ``--warmup-min`` of the clients alone (the baseline: the last
sample before the storm), ``--storm-clients`` (4) more threads keep opening streams of
8 x 256 tokens at K = 64 and vanishing after the first answer (half cancel the call,
half drop the connection) for ``--storm-min`` (2); ``--settle-s`` (30) after the last of
them went, the RSS is compared with the baseline (target: within 50 MiB) while the
clients keep going; reported also their errors and p99 latency before, during and after,
and the RSS once the clients have gone too and the server has idled ``--idle-s`` (20; it
trims after ``--memory-trim-idle-s``).

    python -m benchmarks.soak [--minutes 10] [--warmup-min 2] [--clients 4]
        [--storm [--storm-min 2] [--storm-clients 4] [--settle-s 30]]
        [--server-args "--memory-trim-idle-s 0"]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import psutil

from devtools.launch import TeacherProcess, start_teacher
from devtools.probes import ProbeWatcher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from topk_protocol import build_request, pb_grpc

MIB = 1024 * 1024
DTYPES = ("float32", "float16", "bfloat16")
KINDS = ("heap", "anon", "file")
#: The largest request a client sends: ``MAX_SEQS`` sequences of ``MAX_LEN`` tokens at
#: K = ``MAX_K`` (the load draws 1-4 sequences of 8-256 tokens at K 1-64).
MAX_SEQS, MAX_LEN, MAX_K = 4, 256, 64


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="soak length")
    ap.add_argument("--warmup-min", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--storm", action="store_true", help="a disconnect storm instead")
    ap.add_argument("--storm-min", type=float, default=2.0)
    ap.add_argument("--storm-clients", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=30.0)
    ap.add_argument("--idle-s", type=float, default=20.0, help="storm: then all gone, idle")
    ap.add_argument("--server-args", default="", help="extra teacher-server serve flags")
    ap.add_argument("--target-mib-per-min", type=float, default=2.0)
    ap.add_argument("--target-storm-mib", type=float, default=50.0)
    ap.add_argument("--slope-last-min", type=float, default=10.0)
    ap.add_argument("--probe-s", type=float, default=0.25, help="probe interval")
    ap.add_argument(
        "--largest-rounds",
        type=int,
        default=3,
        help="before the load: rounds of the largest batch the clients can make together (0: none)",
    )
    return ap


class Load:
    """The client threads and their counts; the storm's threads start on demand."""

    def __init__(self, target: str, clients: int) -> None:
        self.target = target
        self.stop = threading.Event()
        self.storm_stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.latencies: list[tuple[float, float]] = []  # (monotonic end, seconds)
        self.cancelled = 0
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]
        self.storm_threads: list[threading.Thread] = []

    def start_storm(self, clients: int) -> None:
        self.storm_threads = [
            threading.Thread(target=self._storm, args=(1000 + i,), daemon=True)
            for i in range(clients)
        ]
        for t in self.storm_threads:
            t.start()

    def end_storm(self) -> None:
        self.storm_stop.set()
        for t in self.storm_threads:
            t.join(120)

    def _client(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpc.insecure_channel(self.target) as ch:
            stub = pb_grpc.TeacherStub(ch)
            while not self.stop.is_set():
                k = int(rng.integers(1, MAX_K + 1))
                dtype = DTYPES[int(rng.integers(0, 3))]
                seqs = [
                    rng.integers(0, 512, int(rng.integers(8, MAX_LEN + 1))).astype(np.int32)
                    for _ in range(int(rng.integers(1, MAX_SEQS + 1)))
                ]
                t0 = time.monotonic()
                try:
                    if rng.random() < 0.5:
                        resp = stub.Score(build_request(seqs, k, dtype=dtype), timeout=120)
                        rows = sum(len(s.ids) for s in resp.sequences) // (4 * k)
                    else:
                        reqs = [
                            build_request(seqs[i : i + 1], k, dtype=dtype) for i in range(len(seqs))
                        ]
                        rows = 0
                        for msg in stub.ScoreStream(iter(reqs), timeout=120):
                            if msg.HasField("error"):
                                raise RuntimeError(msg.error.message)
                            rows += sum(len(s.ids) for s in msg.sequences) // (4 * k)
                    if rows != sum(len(s) for s in seqs):
                        raise RuntimeError(f"{rows} rows for {sum(len(s) for s in seqs)} positions")
                    with self._lock:
                        self.ok += 1
                        self.latencies.append((time.monotonic(), time.monotonic() - t0))
                except Exception as e:  # counted and reported, the soak goes on
                    with self._lock:
                        self.errors.append(f"{type(e).__name__}: {e}"[:200])

    def _storm(self, seed: int) -> None:
        """Streams whose client vanishes after the first answer, the rest in flight."""
        rng = np.random.default_rng(seed)
        n = 0
        while not self.storm_stop.is_set() and not self.stop.is_set():
            ch = grpc.insecure_channel(self.target)
            seqs = [rng.integers(0, 512, 256).astype(np.int32) for _ in range(8)]
            reqs = [build_request([s], 64, dtype="float32") for s in seqs]
            call = pb_grpc.TeacherStub(ch).ScoreStream(iter(reqs), timeout=60)
            with contextlib.suppress(grpc.RpcError):
                next(call)  # the first answer, then gone with the rest in flight
            if n % 2 == 0:
                call.cancel()  # RST_STREAM on a connection that stays up a moment
            ch.close()  # the connection goes (with the call, when not cancelled first)
            n += 1
            with self._lock:
                self.cancelled += 1

    def p99_ms(self, t_from: float, t_to: float) -> float:
        with self._lock:
            lat = [s for end, s in self.latencies if t_from <= end < t_to]
        return float(np.percentile(lat, 99) * 1e3) if lat else float("nan")

    def errors_between(self, n_from: int, n_to: int | None = None) -> int:
        with self._lock:
            return len(self.errors[n_from:n_to])


def send_largest_batch(target: str, clients: int, rounds: int) -> None:
    """``rounds`` times, every client's largest request at once: the largest engine batch
    the load can make, so that the allocators' high-water mark is set before the soak
    measures (else the fit after warm-up sees a step up whenever the random load first
    lines up a batch larger than any before, which is not a leak)."""
    rng = np.random.default_rng(99)
    req = build_request(
        [rng.integers(0, 512, MAX_LEN).astype(np.int32) for _ in range(MAX_SEQS)],
        MAX_K,
        dtype="float32",
    )

    with grpc.insecure_channel(target) as ch, ThreadPoolExecutor(clients) as pool:
        stub = pb_grpc.TeacherStub(ch)
        for _ in range(rounds):
            list(pool.map(lambda _: stub.Score(req, timeout=120), range(clients)))


class Sampler:
    """RSS samples of the server and its engine: ``(t_s, server, engine, kinds, trimmed)``."""

    def __init__(self, server: TeacherProcess, t0: float) -> None:
        self.server = server
        self.t0 = t0
        self.rows: list[tuple[float, int, int, dict[str, int], dict[str, float]]] = []

    def sample(self, load: Load) -> None:
        main_rss, engine_rss = tree_rss(self.server.proc.pid)
        trimmed = trimmed_bytes(self.server.http)
        self.rows.append(
            (
                time.monotonic() - self.t0,
                main_rss,
                engine_rss,
                engine_rss_by_kind(self.server.proc.pid),
                trimmed,
            )
        )
        given = ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(trimmed.items()))
        print(
            f"{self.rows[-1][0]:6.0f} s  server {main_rss / MIB:7.1f} MiB  engine "
            f"{engine_rss / MIB:7.1f} MiB  ok {load.ok}  errors {len(load.errors)}  "
            f"cancelled {load.cancelled}  trimmed MiB: {given or '-'}",
            flush=True,
        )

    def run_until(self, t_s: float, load: Load, sample_s: float) -> None:
        """Sample every ``sample_s`` until ``t_s`` seconds after ``t0``."""
        while time.monotonic() - self.t0 < t_s:
            self.sample(load)
            time.sleep(max(min(sample_s, t_s - (time.monotonic() - self.t0)), 0))


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of the process, RSS of all its descendants), bytes."""
    proc = psutil.Process(pid)
    children = 0
    for c in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            children += c.memory_info().rss
    return proc.memory_info().rss, children


def engine_rss_by_kind(pid: int) -> dict[str, int]:
    """RSS of the server's descendants by mapping kind (``/proc/PID/smaps``): ``heap``
    (glibc's brk heap), ``anon`` (anonymous mappings: large mallocs, other arenas, torch's
    buffers), ``file`` (code, mapped files), bytes. Where a creep lives says whose it is."""
    out = dict.fromkeys(KINDS, 0)
    for c in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(OSError, psutil.NoSuchProcess):
            kind = "anon"
            for line in Path(f"/proc/{c.pid}/smaps").read_text().splitlines():
                head = line.split()
                if not head:
                    continue
                if not head[0].endswith(":"):  # a mapping's first line
                    name = head[5] if len(head) > 5 else ""
                    kind = (
                        "heap" if name == "[heap]" else "file" if name.startswith("/") else "anon"
                    )
                elif head[0] == "Rss:":
                    out[kind] += int(head[1]) * 1024
    return out


_TRIMMED = re.compile(r'^topk_teacher_memory_trimmed_bytes_total\{process="(\w+)"\} (\S+)$', re.M)


def trimmed_bytes(http: str) -> dict[str, float]:
    """What the server's memory trim gave back so far, by process (``/metrics``)."""
    with contextlib.suppress(OSError), urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        return {p: float(v) for p, v in _TRIMMED.findall(r.read().decode())}
    return {}


def slope_mib_per_min(t_s: list[float], rss: list[int]) -> float:
    if len(t_s) < 2:
        return float("nan")
    a = np.polyfit(np.asarray(t_s) / 60, np.asarray(rss, dtype=np.float64) / MIB, 1)
    return float(a[0])


def report_soak(rows: list[tuple[float, int, int, dict[str, int], dict[str, float]]],
                load: Load, args: argparse.Namespace) -> None:  # fmt: skip
    after = [r for r in rows if r[0] >= args.warmup_min * 60]
    last_from = rows[-1][0] - args.slope_last_min * 60 if rows else 0.0
    last = [r for r in after if r[0] >= last_from]
    ts = [r[0] for r in after]
    parts = {
        "server process": [r[1] for r in after],
        "vLLM processes (engine core + worker)": [r[2] for r in after],
        "whole tree": [r[1] + r[2] for r in after],
    }
    for kind in KINDS:
        parts[f"engine: {kind} mappings"] = [r[3][kind] for r in after]
    n_last = len(last)
    print(
        f"\n{load.ok} requests OK, {len(load.errors)} errors; {len(after)} samples after "
        f"{args.warmup_min:g} min of warm-up"
    )
    target = args.target_mib_per_min
    print(
        f"| process | RSS after warm-up, MiB | at the end | slope after warm-up, MiB/min | "
        f"slope over the last {args.slope_last_min:g} min (target <= {target:g}) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, rss in parts.items():
        if rss:
            print(
                f"| {name} | {rss[0] / MIB:.1f} | {rss[-1] / MIB:.1f} | "
                f"{slope_mib_per_min(ts, rss):+.2f} | "
                f"{slope_mib_per_min(ts[-n_last:], rss[-n_last:]):+.2f} |"
            )


def run_storm(sampler: Sampler, load: Load, args: argparse.Namespace) -> None:
    t_storm = args.warmup_min * 60
    sampler.run_until(t_storm, load, args.sample_s)
    sampler.sample(load)
    base = sampler.rows[-1]
    errors_before, t0 = len(load.errors), sampler.t0
    load.start_storm(args.storm_clients)
    sampler.run_until(t_storm + args.storm_min * 60, load, args.sample_s)
    load.end_storm()
    t_end = time.monotonic() - t0
    errors_storm = len(load.errors)
    peak = max((r for r in sampler.rows if r[0] >= t_storm), key=lambda r: r[1] + r[2])
    sampler.run_until(t_end + args.settle_s, load, args.sample_s)
    sampler.sample(load)
    last = sampler.rows[-1]
    t_last = time.monotonic() - t0
    load.stop.set()  # then the clients go too: the server idles and trims
    for t in load.threads:
        t.join(60)
    time.sleep(args.idle_s)
    sampler.sample(load)
    idle = sampler.rows[-1]
    print(
        f"\nstorm: {load.cancelled} streams gone mid-answer in {args.storm_min:g} min "
        f"({args.storm_clients} threads); the {args.clients} clients: {load.ok} requests OK, "
        f"errors before / during / after the storm: {errors_before} / "
        f"{errors_storm - errors_before} / {len(load.errors) - errors_storm}"
    )
    for e in sorted(set(load.errors))[:5]:
        print("  error:", e)
    p99 = [
        load.p99_ms(t0 + a, t0 + b) for a, b in ((0, t_storm), (t_storm, t_end), (t_end, t_last))
    ]
    print("clients' p99 latency, ms: before {:.0f}, during {:.0f}, after {:.0f}".format(*p99))
    print(
        f"| RSS, MiB | server | engine | whole tree |\n|---|---:|---:|---:|\n"
        f"| baseline (t = {base[0]:.0f} s, before the storm) | {base[1] / MIB:.1f} | "
        f"{base[2] / MIB:.1f} | {(base[1] + base[2]) / MIB:.1f} |\n"
        f"| peak during the storm (t = {peak[0]:.0f} s) | {peak[1] / MIB:.1f} | "
        f"{peak[2] / MIB:.1f} | {(peak[1] + peak[2]) / MIB:.1f} |\n"
        f"| {t_last - t_end:.0f} s after the storm (t = {last[0]:.0f} s) | {last[1] / MIB:.1f} | "
        f"{last[2] / MIB:.1f} | {(last[1] + last[2]) / MIB:.1f} |\n"
        f"| after - baseline (target <= {args.target_storm_mib:g}) | "
        f"{(last[1] - base[1]) / MIB:+.1f} | {(last[2] - base[2]) / MIB:+.1f} | "
        f"{(last[1] + last[2] - base[1] - base[2]) / MIB:+.1f} |\n"
        f"| the clients gone too, {args.idle_s:g} s idle (t = {idle[0]:.0f} s) | "
        f"{idle[1] / MIB:.1f} | {idle[2] / MIB:.1f} | {(idle[1] + idle[2]) / MIB:.1f} |"
    )


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", seed=0)
        server = start_teacher(
            [
                "--backend",
                "vllm",
                "--model",
                str(model),
                *TINY_SERVE_ARGS,
                *shlex.split(args.server_args),
            ],
            Path(tmp) / "server.log",
        )
        load = Load(server.target, args.clients)
        probes = ProbeWatcher(server.http, server.target, interval_s=args.probe_s)
        try:
            send_largest_batch(server.target, args.clients, args.largest_rounds)
            sampler = Sampler(server, time.monotonic())
            for t in load.threads:
                t.start()
            with probes:
                if args.storm:
                    run_storm(sampler, load, args)
                else:
                    sampler.run_until(args.minutes * 60, load, args.sample_s)
            load.stop.set()
            for t in load.threads:
                t.join(60)
            with grpc.insecure_channel(server.target) as ch:  # still serving at the end
                pb_grpc.TeacherStub(ch).Score(
                    build_request([np.arange(16, dtype=np.int32)], 8), timeout=60
                )
            print("a last request after the load: OK")
        finally:
            server.stop()
    if not args.storm:
        for e in sorted(set(load.errors))[:5]:
            print("  error:", e)
        report_soak(sampler.rows, load, args)
    print(
        f"probes throughout: {probes.summary()}; HTTP probes over 1 s: {probes.late(1.0)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
