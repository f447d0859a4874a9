"""Probe a teacher the way an orchestrator does, and record how long each answer took.

:class:`ProbeWatcher` runs in a thread: every ``interval_s`` it asks ``/healthz``,
``/readyz`` and the gRPC health service (one fresh HTTP connection per probe, as kubelet
does) and records the latency of each; a probe that fails or takes longer than its
timeout counts as its timeout. Shared by the tests and the benchmarks.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ProbeWatcher"]


@dataclass
class ProbeWatcher:
    """Probe ``http`` (base URL) and ``target`` (gRPC) until :meth:`stop`.

    ``latencies_s``: probe name -> every latency measured, seconds.
    """

    http: str
    target: str
    interval_s: float = 0.05
    timeout_s: float = 5.0
    latencies_s: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="probe-watcher")
        self._channel = grpc.insecure_channel(self.target)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> ProbeWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._channel.close()

    def max_s(self) -> float:
        """The slowest probe of any kind (0 when none ran)."""
        return max((max(v) for v in self.latencies_s.values() if v), default=0.0)

    def count(self) -> int:
        return sum(len(v) for v in self.latencies_s.values())

    def summary(self) -> str:
        parts = []
        for name, v in sorted(self.latencies_s.items()):
            parts.append(f"{name} n={len(v)} max {max(v) * 1e3:.0f} ms" if v else f"{name} n=0")
        return ", ".join(parts)

    def _time(self, name: str, fn: object) -> None:
        t0 = time.perf_counter()
        try:
            fn()  # type: ignore[operator]
            took = time.perf_counter() - t0
        except Exception:
            took = self.timeout_s
        self.latencies_s.setdefault(name, []).append(took)

    def _run(self) -> None:
        def http(path: str) -> None:
            # 503 while loading or draining is an answer too.
            with contextlib.suppress(urllib.error.HTTPError):
                urllib.request.urlopen(f"{self.http}{path}", timeout=self.timeout_s).read()

        def grpc_health() -> None:
            self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)

        while not self._stop.is_set():
            self._time("healthz", lambda: http("/healthz"))
            self._time("readyz", lambda: http("/readyz"))
            self._time("grpc_health", grpc_health)
            self._stop.wait(self.interval_s)
