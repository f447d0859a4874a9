"""Prometheus metrics of the teacher, on a registry of their own (one per server)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from teacher_server.alignment import RowKind
from teacher_server.backends.base import ComputeCounts
from teacher_server.process_memory import tree_resident_bytes

__all__ = ["ComputeCollector", "ProcessMemoryCollector", "TeacherMetrics"]


class ComputeCollector(Collector):
    """The engine's compute against what it answered (a backend's
    :class:`~teacher_server.backends.base.ComputeCounts`), read at every scrape."""

    def __init__(self, counts: ComputeCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        yield CounterMetricFamily(
            "topk_teacher_engine_tokens",
            "Tokens of the sequences sent to the engine (whole sequences, every position "
            "the answers depend on).",
            value=c.tokens,
        )
        yield CounterMetricFamily(
            "topk_teacher_engine_cached_tokens",
            "Of those, tokens read from the engine's prefix cache (not computed again).",
            value=c.cached_tokens,
        )
        yield CounterMetricFamily(
            "topk_teacher_positions_computed",
            "Positions the engine ran its forward pass over (tokens minus cached tokens).",
            value=c.positions_computed,
        )
        yield CounterMetricFamily(
            "topk_teacher_positions_answered",
            "Positions the engine answered (payload rows it produced).",
            value=c.positions_answered,
        )
        yield GaugeMetricFamily(
            "topk_teacher_shared_rows_bytes",
            "Bytes of answers' rows kept now to answer later requests for the same prefix "
            "(--shared-rows-mib; cleared at the start of each quiet spell's memory trim).",
            value=c.shared_row_bytes,
        )
        yield GaugeMetricFamily(
            "topk_teacher_cached_token_ratio",
            "Cached tokens / engine tokens since start-up (0 to 1; 0 before any request).",
            value=c.cached_tokens / c.tokens if c.tokens else 0.0,
        )


class ProcessMemoryCollector(Collector):
    """Resident bytes of the server's process tree by process and kind
    (:mod:`teacher_server.process_memory`), read from ``/proc`` at every scrape."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "topk_teacher_process_resident_bytes",
            "Resident bytes of the server's process tree, by process (server, engine_core, "
            "worker: vLLM's; other) and kind (anonymous; file: libraries, shared with "
            "other processes; shared: shared memory such as vLLM's message queues, mapped "
            "by the engine core and the worker both, so counted in each).",
            labels=["process", "kind"],
        )
        for (process, kind), value in sorted(tree_resident_bytes().items()):
            family.add_metric([process, kind], value)
        yield family


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


#: How many (method, field) pairs of ignored body fields are logged, once each.
MAX_NOTED_FIELDS = 256


class TeacherMetrics:
    """Counters and histograms exported on ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "topk_teacher_requests",
            "Score requests answered, by method and status code (gRPC's code names).",
            ["method", "code"],
            registry=self.registry,
        )
        self.positions = Counter(
            "topk_teacher_positions_scored",
            "Positions scored (rows of payload sent).",
            registry=self.registry,
        )
        self.payload_bytes = Counter(
            "topk_teacher_payload_bytes",
            "Bytes of payload arrays (ids, log-probs, sampled log-probs) sent.",
            registry=self.registry,
        )
        self.latency = Histogram(
            "topk_teacher_request_latency_seconds",
            "Time from request received to last response message, by method.",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "topk_teacher_requests_in_flight",
            "Score requests being worked on now.",
            registry=self.registry,
        )
        self.queued = Gauge(
            "topk_teacher_requests_queued",
            "Score requests waiting for a slot (at most --max-queued-requests).",
            registry=self.registry,
        )
        self.memory_trimmed = Counter(
            "topk_teacher_memory_trimmed_bytes",
            "Resident bytes the quiet-spell trim gave back to the OS (--memory-trim-idle-s): "
            "malloc_trim, and vLLM's message-queue pages, by process (server; engine: "
            "vLLM's engine core and workers).",
            ["process"],
            registry=self.registry,
        )
        self.ignored_fields = Counter(
            "topk_teacher_http_ignored_fields",
            "Request body fields accepted and ignored, as the stock server ignores them, by "
            "method and field ('(undeclared)': a field the stock server does not declare).",
            ["method", "field"],
            registry=self.registry,
        )
        self._noted_fields: set[tuple[str, str]] = set()
        self.student_rows = Counter(
            "topk_teacher_student_rows",
            "Rows answered to a student of another tokenizer (--student-tokenizer), by kind: "
            "aligned (the teacher's row at the same bytes and the next token's chain-rule "
            "log-prob), boundary (the row only), masked (none: the prefix ends inside a "
            "teacher token).",
            ["kind"],
            registry=self.registry,
        )
        self.streams_open = Gauge(
            "topk_teacher_streams_open",
            "ScoreStream calls whose per-stream state (budget, answers not yet sent) is "
            "still alive on the server.",
            registry=self.registry,
        )
        self.stream_unsent_bytes = Gauge(
            "topk_teacher_stream_unsent_bytes",
            "Bytes of answers reserved by open ScoreStream calls and not yet handed to "
            "gRPC (slow readers' answers), summed over the streams.",
            registry=self.registry,
        )
        self.registry.register(ProcessMemoryCollector())

    def watch_compute(self, counts: ComputeCounts | None) -> None:
        """Export a backend's compute counts (:class:`ComputeCollector`); None: nothing."""
        if counts is not None:
            self.registry.register(ComputeCollector(counts))

    def count_ignored_field(self, method: str, path: str, label: str) -> bool:
        """Count one ignored body field (``path``, labelled ``label``) of ``method``; True
        the first time ``(method, path)`` is seen, for one log line each (at most
        :data:`MAX_NOTED_FIELDS` pairs are remembered: a client may send any names)."""
        self.ignored_fields.labels(method, label).inc()
        key = (method, path)
        if key in self._noted_fields or len(self._noted_fields) >= MAX_NOTED_FIELDS:
            return False
        self._noted_fields.add(key)
        return True

    def count_student_rows(self, kinds: npt.NDArray[np.int8] | None) -> None:
        """Count a student tokenizer's answer rows by kind (``[S]`` ``RowKind`` values)."""
        if kinds is None:
            return
        counts = np.bincount(kinds, minlength=len(RowKind))
        for kind in RowKind:
            self.student_rows.labels(kind.name.lower()).inc(int(counts[kind]))

    def set_load(self, in_flight: int, queued: int) -> None:
        """Admission's counts: requests working and requests waiting for a slot."""
        self.in_flight.set(in_flight)
        self.queued.set(queued)
