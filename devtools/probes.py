"""Probe a teacher the way an orchestrator does, and record how long each answer took.

:class:`ProbeWatcher` probes from a separate process (so that the load generator's own
threads and GIL in the calling process do not delay the probes and inflate what is
measured): every ``interval_s`` it asks ``/healthz``, ``/readyz`` and the gRPC health
service (one fresh HTTP connection per probe, as kubelet does) and records the latency of
each; a probe that fails or takes longer than its timeout counts as its timeout. Shared
by the tests and the benchmarks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ProbeWatcher"]


def _probe_loop(http: str, target: str, interval_s: float, timeout_s: float, conn: Any) -> None:
    """The child process: probe until told to stop, then send the latencies back."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    latencies: dict[str, list[float]] = {}
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)

    def get(path: str) -> None:
        # 503 while loading or draining is an answer too.
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(f"{http}{path}", timeout=timeout_s).read()

    probes = {
        "healthz": lambda: get("/healthz"),
        "readyz": lambda: get("/readyz"),
        "grpc_health": lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s),
    }
    first = True
    while True:
        for name, probe in probes.items():
            t0 = time.perf_counter()
            try:
                probe()
                took = time.perf_counter() - t0
            except Exception:
                took = timeout_s
            latencies.setdefault(name, []).append(took)
        if first:
            # The first round sets up the gRPC channel and this process's sockets: not
            # what the server's answer time is; measure from the next round on.
            latencies.clear()
            conn.send("ready")
            first = False
        if conn.poll(interval_s):
            break
    channel.close()
    conn.send(latencies)


@dataclass
class ProbeWatcher:
    """Probe ``http`` (base URL) and ``target`` (gRPC) from ``with`` until its end.

    ``latencies_s``: probe name -> every latency measured, seconds (filled at the end).
    """

    http: str
    target: str
    interval_s: float = 0.05
    timeout_s: float = 5.0
    latencies_s: dict[str, list[float]] = field(default_factory=dict)

    def __enter__(self) -> ProbeWatcher:
        ctx = multiprocessing.get_context("spawn")  # no fork of the caller's gRPC threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_probe_loop,
            args=(self.http, self.target, self.interval_s, self.timeout_s, child),
            daemon=True,
        )
        self._proc.start()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            self._proc.kill()
            raise RuntimeError("probe process did not start probing within 120 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        if self._conn.poll(60):
            self.latencies_s = self._conn.recv()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def max_s(self) -> float:
        """The slowest probe of any kind (0 when none ran)."""
        return max((max(v) for v in self.latencies_s.values() if v), default=0.0)

    def count(self) -> int:
        return sum(len(v) for v in self.latencies_s.values())

    def late(self, limit_s: float, names: tuple[str, ...] = ("healthz", "readyz")) -> int:
        """Probes of ``names`` that took longer than ``limit_s`` (or failed)."""
        return sum(t > limit_s for n in names for t in self.latencies_s.get(n, ()))

    def summary(self) -> str:
        parts = []
        for name, v in sorted(self.latencies_s.items()):
            parts.append(f"{name} n={len(v)} max {max(v) * 1e3:.0f} ms" if v else f"{name} n=0")
        return ", ".join(parts)
