"""Assembles the teacher process: gRPC (Teacher + Health + reflection) and HTTP on one
asyncio loop, engine start-up in the background, and a draining shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from student_client.wire import pb, pb_grpc
from teacher_server.auth import BearerTokenInterceptor
from teacher_server.backends.base import Backend
from teacher_server.http_app import build_http_app
from teacher_server.metrics import TeacherMetrics
from teacher_server.servicer import TeacherServicer, teacher_info_message
from teacher_server.validation import Limits

__all__ = ["ServerConfig", "TeacherServer", "run_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Teacher"].full_name  # topk_distill.v1.Teacher


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the process's signal handlers stay ours (drain on SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve. ``max_top_k`` etc. become the :class:`Limits`."""

    host: str = "0.0.0.0"
    port: int = 50051
    http_host: str | None = None  # None: same as host
    http_port: int = 8000  # 0 disables HTTP
    max_top_k: int = 64
    max_tokens_per_request: int = 262_144
    max_inflight_requests: int = 64
    max_message_mb: int = 64
    chunk_kb: int = 1024
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token: str | None = None
    drain_timeout_s: float = 30.0
    warmup: bool = True


class TeacherServer:
    """One teacher process. ``await start()``, then ``await wait_ready()``; ``await stop()``
    drains: health NOT_SERVING, new requests refused, in-flight ones finish."""

    def __init__(self, backend: Backend, config: ServerConfig) -> None:
        self._backend = backend
        self._config = config
        self._metrics = TeacherMetrics()
        self._limits = Limits(
            vocab_size=0,
            max_top_k=config.max_top_k,
            max_tokens_per_request=config.max_tokens_per_request,
            max_inflight_requests=config.max_inflight_requests,
            max_message_bytes=config.max_message_mb * 1024 * 1024,
            chunk_bytes=config.chunk_kb * 1024,
        )
        self._servicer = TeacherServicer(backend, self._limits, self._metrics)
        self._health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._draining = False
        self._info: pb.TeacherInfo | None = None
        self.port = config.port
        self.http_port = config.http_port

    # -- state read by the HTTP app ----------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._draining

    def is_draining(self) -> bool:
        return self._draining

    def info(self) -> pb.TeacherInfo | None:
        return self._info

    @property
    def metrics(self) -> TeacherMetrics:
        return self._metrics

    # -- lifecycle ---------------------------------------------------------------------
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
        pb_grpc.add_TeacherServicer_to_server(self._servicer, self._grpc)
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
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("tls_cert/tls_key: give both the certificate and the key")
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
            )
            self.port = self._grpc.add_secure_port(address, creds)
        else:
            self.port = self._grpc.add_insecure_port(address)
        await self._grpc.start()
        if cfg.http_port is not None and cfg.http_port >= 0:
            await self._start_http()
        log.info(
            "gRPC on %s:%d, HTTP on %s; loading the engine", cfg.host, self.port, self.http_port
        )
        self._load_task = asyncio.create_task(self._load())

    async def _start_http(self) -> None:
        cfg = self._config
        app = build_http_app(
            is_ready=self.is_ready,
            is_draining=self.is_draining,
            info=self.info,
            metrics=self._metrics,
            token=cfg.token,
        )
        ucfg = uvicorn.Config(
            app,
            host=cfg.http_host or cfg.host,
            port=cfg.http_port,
            log_level="warning",
            lifespan="off",
        )
        self._http = _EmbeddedUvicorn(ucfg)
        self._http_task = asyncio.create_task(self._http.serve())
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError(f"HTTP server failed to start on port {cfg.http_port}")
            await asyncio.sleep(0.02)
        sockets = [s for srv in self._http.servers for s in srv.sockets]
        if sockets:
            self.http_port = sockets[0].getsockname()[1]

    async def _load(self) -> None:
        try:
            await self._backend.start()
            info = self._backend.info
            max_len = info.max_sequence_length
            self._limits = dataclasses.replace(
                self._limits, vocab_size=info.vocab_size, max_sequence_length=max_len
            )
            if self._config.max_top_k > info.max_top_k:
                raise ValueError(
                    f"max_top_k: {self._config.max_top_k} exceeds what the engine "
                    f"serves ({info.max_top_k})"
                )
            self._servicer.set_ready(self._limits)
            if self._config.warmup:
                await self._backend.warmup()
            self._info = teacher_info_message(self._backend, self._limits)
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._ready.set()
            log.info("teacher ready: %s", info)
        except Exception:
            log.exception("engine failed to start")
            raise

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            res = self._health.set(service, status)
            if asyncio.iscoroutine(res):
                await res

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the engine is warmed up; raise if it failed to load."""
        assert self._load_task is not None, "call start() first"
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, self._load_task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if self._load_task in done and self._load_task.exception():
            ready.cancel()
            raise RuntimeError("engine failed to start") from self._load_task.exception()
        if not done:
            ready.cancel()
            raise TimeoutError(f"teacher not ready after {timeout_s} s")
        await ready

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new requests, finish in-flight ones, close."""
        if self._draining:
            return
        self._draining = True
        self._servicer.set_draining()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        timeout = self._config.drain_timeout_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._servicer.wait_idle(), timeout)
        if self._grpc is not None:
            await self._grpc.stop(grace=timeout)
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(BaseException):
                await self._load_task
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                with contextlib.suppress(BaseException):
                    await self._http_task
        await self._backend.close()

    async def wait_for_termination(self) -> None:
        assert self._grpc is not None
        await self._grpc.wait_for_termination()


async def run_server(backend: Backend, config: ServerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain and return 0 (1 if the engine failed)."""
    server = TeacherServer(backend, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    assert server._load_task is not None
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, server._load_task}, return_when=asyncio.FIRST_COMPLETED)
    failed = server._load_task.done() and server._load_task.exception() is not None
    if not failed:
        await stopper
    log.info("draining (%d requests in flight)", server._servicer.in_flight)
    await server.stop()
    return 1 if failed else 0
