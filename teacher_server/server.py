"""Assembles the teacher process: gRPC (Teacher + Health + reflection) on the serving
asyncio loop, HTTP on a thread of its own that answers the probes there and forwards the
other routes to the serving loop (:mod:`teacher_server.http_api.thread`), the engine loaded in
the background, and a draining shutdown within one time budget (``drain_timeout_s``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from teacher_server.admission import AdmissionQueue
from teacher_server.answer_fingerprint import announce_fingerprint
from teacher_server.backends.base import Backend
from teacher_server.config import MIB, HttpLimits, ServerConfig
from teacher_server.fair_share import FAIR
from teacher_server.grpc_api.auth import BearerTokenInterceptor
from teacher_server.grpc_api.handlers import SERVICE_NAME, teacher_rpc_handler
from teacher_server.grpc_api.servicer import TeacherServicer, teacher_info_message
from teacher_server.http_api.app import build_http_app
from teacher_server.http_api.limits import BodyLimitMiddleware, uvicorn_kwargs
from teacher_server.http_api.sglang.serving import SGLangEndpoints
from teacher_server.http_api.thread import HttpThread, ProbeFront
from teacher_server.http_api.trl import TRLEndpoints
from teacher_server.http_api.vllm.serving import VLLMEndpoints
from teacher_server.lifecycle import (
    ENGINE_SHUTDOWN_S,
    SHUTDOWN_MARGIN_S,
    Lifecycle,
    Phase,
)
from teacher_server.malloc_trim import trim_when_quiet
from teacher_server.metrics import TeacherMetrics
from teacher_server.pipeline import RequestPipeline
from teacher_server.student_tokenizers import StudentTokenizers
from teacher_server.validation import Limits
from topk_protocol import pb

__all__ = ["ServerConfig", "TeacherServer", "run_server"]

log = logging.getLogger(__name__)

#: At most this long, within the drain budget, is left for answers already computed to
#: reach their clients once no request is working any more.
_FLUSH_S = 2.0

#: The servers of this process whose start-up objects are frozen (``gc.freeze`` is per
#: process: the last of them to stop unfreezes; ids).
_FROZEN_BY: set[int] = set()


class TeacherServer:
    """One teacher process. ``await start()`` opens both ports at once and loads the engine
    in the background; ``await wait_ready()``; ``await stop()`` drains within
    ``drain_timeout_s``. Its :class:`Lifecycle` is the one record of the phase."""

    def __init__(
        self,
        backend: Backend,
        config: ServerConfig,
        students: StudentTokenizers | None = None,
    ) -> None:
        self._backend = backend
        self._config = config
        # Loaded now (a bad --student-tokenizer fails before the engine starts); paired
        # with the teacher's tokenizer once the engine is up.
        self._students = students or StudentTokenizers(config.student_tokenizer)
        self._metrics = TeacherMetrics()
        self._limits = Limits.from_config(config)
        self.lifecycle = Lifecycle()
        self._admission = AdmissionQueue(
            config.max_inflight_requests,
            config.max_queued_requests,
            self._metrics.set_load,
            fair=config.admission_order == FAIR,
        )
        self._pipeline = RequestPipeline(
            backend,
            self._limits,
            self._metrics,
            self.lifecycle,
            self._admission,
            students=self._students,
        )
        self._servicer = TeacherServicer(
            self._pipeline,
            stream_budget=(
                config.stream_max_unsent_requests,
                config.stream_max_unsent_mb * MIB,
            ),
        )
        self._health = health.aio.HealthServicer()
        self.lifecycle.subscribe(self._on_phase)
        self._grpc: grpc.aio.Server | None = None
        self._http: HttpThread | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._info: pb.TeacherInfo | None = None
        self.port = config.port
        self.http_port = config.http_port

    def info(self) -> pb.TeacherInfo | None:
        """The GetInfo answer once ready (``None`` before)."""
        return self._info

    @property
    def metrics(self) -> TeacherMetrics:
        return self._metrics

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for an admission slot."""
        return self._admission.queued

    @property
    def load_task(self) -> asyncio.Task[None] | None:
        """The engine load and warm-up (set by :meth:`start`)."""
        return self._load_task

    # -- lifecycle ---------------------------------------------------------------------
    async def _on_phase(self, phase: Phase) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if phase is Phase.READY
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._set_health(status)
        if phase is Phase.DRAINING:
            refusal = self.lifecycle.refusal()
            self._admission.close(refusal or "teacher: shutting down")

    async def start(self) -> None:
        """Open both ports, then load and warm up the engine in the background."""
        cfg = self._config
        opts = [
            ("grpc.max_send_message_length", self._limits.max_message_bytes),
            ("grpc.max_receive_message_length", self._limits.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [BearerTokenInterceptor(cfg.token)] if cfg.token else []
        self._grpc = grpc.aio.server(options=opts, interceptors=interceptors)
        self._grpc.add_generic_rpc_handlers((teacher_rpc_handler(self._servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._grpc,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        tls = _tls_files(cfg)
        if tls is not None:
            cert, key = tls
            creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
            self.port = self._grpc.add_secure_port(address, creds)
        else:
            self.port = self._grpc.add_insecure_port(address)
        await self._grpc.start()
        if cfg.http_port is not None and cfg.http_port >= 0:
            await self._start_http(tls)
        log.info(
            "gRPC on %s:%d, HTTP%s on %s:%s; loading the engine",
            cfg.host,
            self.port,
            "S" if tls else "",
            cfg.http_host or cfg.host,
            self.http_port,
        )
        self._load_task = asyncio.create_task(self._load())

    async def _start_http(self, tls: tuple[Path, Path] | None) -> None:
        cfg = self._config
        trl = TRLEndpoints(self._pipeline, self.info)
        app = build_http_app(
            lifecycle=self.lifecycle,
            info=self.info,
            metrics=self._metrics,
            token=cfg.token,
            trl=trl,
            sglang=SGLangEndpoints(self._pipeline, self.info),
            vllm=VLLMEndpoints(self._pipeline, self.info),
        )
        limits = cfg.http_limits or HttpLimits()
        # The probes are answered on the HTTP thread; the rest runs on this loop.
        front = ProbeFront(
            app, asyncio.get_running_loop(), self.lifecycle, self._backend.engine_alive
        )
        ucfg = uvicorn.Config(
            # Every route: the body limits wrap the whole app (teacher_server.http_api.limits).
            BodyLimitMiddleware(
                front, max_body_bytes=limits.max_body_bytes, body_timeout_s=limits.body_timeout_s
            ),
            host=cfg.http_host or cfg.host,
            port=cfg.http_port,
            log_level="warning",
            lifespan="off",
            # With TLS the HTTP side serves HTTPS with the same certificate: /v1/info
            # carries the bearer token.
            ssl_certfile=str(tls[0]) if tls else None,
            ssl_keyfile=str(tls[1]) if tls else None,
            **uvicorn_kwargs(limits),
        )
        self._http = HttpThread(ucfg)
        self.http_port = await self._http.start()

    async def _load(self) -> None:
        try:
            await self._backend.start()
            _freeze_startup_objects(self)
            info = self._backend.info
            max_len = info.max_sequence_length
            self._limits = dataclasses.replace(
                self._limits,
                vocab_size=info.vocab_size,
                max_sequence_length=max_len,
                # The server's limit, where the backend scores candidates at all.
                max_candidates=min(self._limits.max_candidates, info.max_candidates),
                max_samples=info.max_samples,
            )
            if self._config.max_top_k > info.max_top_k:
                raise ValueError(
                    f"max_top_k: {self._config.max_top_k} exceeds what the engine "
                    f"serves ({info.max_top_k})"
                )
            self._pipeline.set_limits(self._limits)
            await asyncio.to_thread(self._students.pair, self._backend.tokenizer, info.vocab_size)
            if self._config.warmup:
                await self._backend.warmup()
            await announce_fingerprint(self._backend, self._config.expect_fingerprint)
            _freeze_startup_objects(self)
            self._info = teacher_info_message(self._backend, self._limits, self._students)
            if self._config.memory_trim_idle_s > 0:
                self._trim_task = asyncio.create_task(
                    trim_when_quiet(
                        self._config.memory_trim_idle_s,
                        lambda: self._admission.quiet_since,
                        self._backend.trim_memory,
                        lambda process, n: self._metrics.memory_trimmed.labels(process).inc(n),
                        self._backend.drop_caches,
                    )
                )
            if await self.lifecycle.advance(Phase.READY):
                # What the server serves: the engine's capability capped by the flags.
                served = dataclasses.replace(info, max_candidates=self._limits.max_candidates)
                log.info("teacher ready: %s (engine dtype %s)", served, info.dtype or "n/a")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine failed to start")
            await self.lifecycle.advance(Phase.FAILED)
            raise

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the engine is warmed up; raise if it failed to load."""
        if self._load_task is None:
            raise RuntimeError("TeacherServer.wait_ready: call start() first")
        await asyncio.wait_for(asyncio.shield(self._load_task), timeout_s)

    async def stop(self) -> None:
        """Drain within ``drain_timeout_s``: NOT_SERVING, refuse new and queued requests,
        let the ones working finish, close. One deadline covers every step."""
        if self._stopping:
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.drain_timeout_s

        def left() -> float:
            return max(deadline - loop.time(), 0.0)

        await self.lifecycle.advance(Phase.DRAINING)
        if self._trim_task is not None:
            self._trim_task.cancel()
            with contextlib.suppress(BaseException):
                await self._trim_task
        log.info("draining: %d requests in flight, %.0f s budget", self.in_flight, left())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._admission.wait_idle(), left())
        if self._admission.in_flight:
            log.warning("drain budget spent: cancelling %d requests", self._admission.in_flight)
        if self._grpc is not None:
            await self._grpc.stop(grace=min(left(), _FLUSH_S))
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(BaseException):
                await self._load_task
        if self._http is not None:
            await self._http.stop(SHUTDOWN_MARGIN_S - ENGINE_SHUTDOWN_S - 1)
        try:
            # The backend bounds its own close by ENGINE_SHUTDOWN_S; one second of slack.
            await asyncio.wait_for(self._backend.close(), ENGINE_SHUTDOWN_S + 1)
        except TimeoutError:
            log.warning("the engine did not close within %.1f s", ENGINE_SHUTDOWN_S + 1)
        _unfreeze_startup_objects(self)
        log.info("stopped")


def _freeze_startup_objects(server: TeacherServer) -> None:
    """Move every object alive now (the engine's, torch's, the modules') out of the cyclic
    garbage collector's reach (``gc.freeze``): they live as long as the process, and a
    full collection scanning them all held the event loop, probes included, for up to
    1.5 s under load. vLLM's engine process does the same. No ``gc.collect()`` first: that
    would be one such pause, on the loop; ``gc.freeze`` itself only moves lists."""
    gc.freeze()
    _FROZEN_BY.add(id(server))
    log.info("gc: %d start-up objects frozen", gc.get_freeze_count())


def _unfreeze_startup_objects(server: TeacherServer) -> None:
    """Put the frozen objects back under the collector (``gc.unfreeze``) once the last
    server of this process that froze them has stopped, as vLLM's engine core does at its
    shutdown. Frozen objects outlive even the interpreter's final collection: an extension
    whose objects sit in a frozen reference cycle then reports them leaked at exit (Triton's
    nanobind module, imported through ``torch._dynamo``, prints hundreds of lines after a
    process that ran a server in-process, e.g. the test suite)."""
    if id(server) not in _FROZEN_BY:
        return
    _FROZEN_BY.discard(id(server))
    if not _FROZEN_BY:
        gc.unfreeze()


def _tls_files(cfg: ServerConfig) -> tuple[Path, Path] | None:
    """``(cert, key)`` when TLS is configured."""
    if not (cfg.tls_cert or cfg.tls_key):
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("tls_cert/tls_key: give both the certificate and the key")
    return Path(cfg.tls_cert), Path(cfg.tls_key)


async def run_server(
    backend: Backend, config: ServerConfig, students: StudentTokenizers | None = None
) -> int:
    """Serve until SIGTERM or SIGINT, then drain and return 0 (1 if the engine failed)."""
    server = TeacherServer(backend, config, students)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    load = server.load_task
    assert load is not None  # set by start()
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, load}, return_when=asyncio.FIRST_COMPLETED)
    failed = load.done() and not load.cancelled() and load.exception() is not None
    if not failed:
        await stopper
    await server.stop()
    return 1 if failed else 0
