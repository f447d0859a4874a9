"""Soak: does the teacher's memory creep under steady load?

One vLLM teacher on the tiny model (CPU). ``--clients`` (4) threads send, for
``--minutes`` (10), a mix of ``Score`` and ``ScoreStream`` requests with K from 1 to 64
and all three dtypes, checking every answer's shape; with ``--storm`` one more thread
keeps opening streams and cancelling them mid-answer (a disconnect storm). Every
``--sample-s`` (10) the RSS of the server process and of its children (vLLM's engine
process) is sampled. Reported: the RSS slope in MiB/min after ``--warmup-min`` (2) by a
least-squares fit, per process and for the whole tree, against the target of 2 MiB/min;
the requests served and errors.

    python -m benchmarks.soak [--minutes 10] [--warmup-min 2] [--clients 4] [--storm]
        [--server-args "--engine-topk vllm"]
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

from devtools.launch import start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from topk_protocol import DTYPE_NAMES, build_request, pb_grpc

MIB = 1024 * 1024
DTYPES = ("float32", "float16", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-min", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--storm", action="store_true", help="also cancel streams mid-answer")
    ap.add_argument("--server-args", default="", help="extra teacher-server serve flags")
    ap.add_argument("--target-mib-per-min", type=float, default=2.0)
    return ap


class Load:
    """The client threads and their counts."""

    def __init__(self, target: str, clients: int, storm: bool) -> None:
        self.target = target
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.cancelled = 0
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]
        if storm:
            self.threads.append(threading.Thread(target=self._storm, daemon=True))

    def _client(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpc.insecure_channel(self.target) as ch:
            stub = pb_grpc.TeacherStub(ch)
            while not self.stop.is_set():
                k = int(rng.integers(1, 65))
                dtype = DTYPES[int(rng.integers(0, 3))]
                seqs = [
                    rng.integers(0, 512, int(rng.integers(8, 257))).astype(np.int32)
                    for _ in range(int(rng.integers(1, 5)))
                ]
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
                except Exception as e:  # counted and reported, the soak goes on
                    with self._lock:
                        self.errors.append(f"{type(e).__name__}: {e}"[:200])

    def _storm(self) -> None:
        rng = np.random.default_rng(1000)
        while not self.stop.is_set():
            with grpc.insecure_channel(self.target) as ch:
                seqs = [rng.integers(0, 512, 256).astype(np.int32) for _ in range(8)]
                reqs = [build_request([s], 64, dtype="float32") for s in seqs]
                call = pb_grpc.TeacherStub(ch).ScoreStream(iter(reqs), timeout=60)
                with contextlib.suppress(grpc.RpcError):
                    next(call)  # the first answer, then gone with the rest in flight
                call.cancel()
                with self._lock:
                    self.cancelled += 1


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
    out = {"heap": 0, "anon": 0, "file": 0}
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


def slope_mib_per_min(t_s: list[float], rss: list[int]) -> float:
    if len(t_s) < 2:
        return float("nan")
    a = np.polyfit(np.asarray(t_s) / 60, np.asarray(rss, dtype=np.float64) / MIB, 1)
    return float(a[0])


def main() -> None:
    args = build_parser().parse_args()
    _ = DTYPE_NAMES  # the three dtypes served
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
        load = Load(server.target, args.clients, args.storm)
        samples: list[tuple[float, int, int]] = []
        kinds: list[dict[str, int]] = []
        try:
            t0 = time.monotonic()
            for t in load.threads:
                t.start()
            end = t0 + args.minutes * 60
            while time.monotonic() < end:
                main_rss, engine_rss = tree_rss(server.proc.pid)
                samples.append((time.monotonic() - t0, main_rss, engine_rss))
                kinds.append(engine_rss_by_kind(server.proc.pid))
                print(
                    f"{samples[-1][0]:6.0f} s  server {main_rss / MIB:7.1f} MiB  engine "
                    f"{engine_rss / MIB:7.1f} MiB  ok {load.ok}  errors {len(load.errors)}",
                    flush=True,
                )
                time.sleep(args.sample_s)
            load.stop.set()
            for t in load.threads:
                t.join(60)
        finally:
            server.stop()
    keep = [i for i, s in enumerate(samples) if s[0] >= args.warmup_min * 60]
    after = [samples[i] for i in keep]
    ts = [s[0] for s in after]
    parts = {
        "server process": [s[1] for s in after],
        "engine process(es)": [s[2] for s in after],
        "whole tree": [s[1] + s[2] for s in after],
    }
    for kind in ("heap", "anon", "file"):
        parts[f"engine: {kind} mappings"] = [kinds[i][kind] for i in keep]
    print(
        f"\n{load.ok} requests OK, {len(load.errors)} errors, {load.cancelled} streams "
        f"cancelled mid-answer; {len(after)} samples after {args.warmup_min:g} min of warm-up"
    )
    for e in sorted(set(load.errors))[:5]:
        print("  error:", e)
    target = args.target_mib_per_min
    print(
        f"| process | RSS after warm-up, MiB | at the end | slope, MiB/min (target <= {target:g}) |"
    )
    print("|---|---:|---:|---:|")
    for name, rss in parts.items():
        if rss:
            print(
                f"| {name} | {rss[0] / MIB:.1f} | {rss[-1] / MIB:.1f} | "
                f"{slope_mib_per_min(ts, rss):+.2f} |"
            )


if __name__ == "__main__":
    main()
