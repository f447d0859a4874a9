"""The HTTP port on its own thread and event loop, with the probes answered there.

Why a thread of its own: anything that holds the serving loop (the one that runs gRPC,
admission and the engine's output handling; a burst of 100,000 tiny requests, a long
garbage-collector pass) would hold probes answered there too, and an orchestrator's 1 s
probe timeout would restart a healthy teacher. So uvicorn runs in a thread of its own
with its own loop (:class:`HttpThread`) and :class:`ProbeFront`
answers the probes in that loop from the :class:`~teacher_server.lifecycle.Lifecycle`
alone: the serving loop's load cannot delay them, only the GIL can, and Python hands the
GIL over every 5 ms (``sys.getswitchinterval``). Every other route (``/metrics``,
``/v1/info``, TRL's calls) is forwarded to the FastAPI app on the serving loop, where the
pipeline lives, unchanged: same port, same answers.

Readiness turns false only for a real reason: the lifecycle is not READY (loading,
draining, failed) or the engine says it is lost (``engine_alive()`` false); a busy loop
is no reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

from teacher_server.lifecycle import Lifecycle, Phase

__all__ = ["PROBE_PATHS", "HttpThread", "ProbeFront", "probe_answer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Answered in the HTTP thread, never forwarded to the serving loop.
PROBE_PATHS = ("/healthz", "/readyz")


def _json(body: dict[str, str]) -> bytes:
    """Compact JSON, byte for byte what FastAPI's JSONResponse writes for the same dict."""
    return json.dumps(body, separators=(",", ":")).encode()


def probe_answer(path: str, lifecycle: Lifecycle, engine_alive: bool) -> tuple[int, bytes]:
    """``(status, JSON body)`` of a probe. ``/healthz``: 200 while the process answers at
    all. ``/readyz``: 200 when READY and the engine alive; else 503 with the reason."""
    phase = lifecycle.phase
    if path == "/healthz":
        return 200, _json({"status": "alive", "phase": phase.value})
    if phase is Phase.READY and not engine_alive:
        return 503, _json({"status": "engine_lost"})
    status = "loading" if phase is Phase.STARTING else phase.value
    return (200 if phase is Phase.READY else 503), _json({"status": status})


class ProbeFront:
    """ASGI app run by the HTTP thread: ``GET``/``HEAD`` of :data:`PROBE_PATHS` answered
    here; anything else handed to ``app`` on ``serving_loop`` (its ``receive``/``send``
    bridged back to this loop). A forwarded request cancelled here (client gone, server
    closing) is cancelled there too."""

    def __init__(
        self,
        app: Callable[..., Coroutine[Any, Any, None]],
        serving_loop: asyncio.AbstractEventLoop,
        lifecycle: Lifecycle,
        engine_alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self._app = app
        self._loop = serving_loop
        self._lifecycle = lifecycle
        self._engine_alive = engine_alive

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in PROBE_PATHS
            and scope["method"] in ("GET", "HEAD")
        ):
            status, body = probe_answer(scope["path"], self._lifecycle, self._alive())
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if scope["method"] == "HEAD":
                body = b""
            await send({"type": "http.response.body", "body": body})
            return
        await self._forward(scope, receive, send)

    def _alive(self) -> bool:
        try:
            return bool(self._engine_alive())
        except Exception:  # a probe never fails on a broken check: it reports it
            log.exception("engine_alive() failed")
            return False

    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        here = asyncio.get_running_loop()

        async def on_here(coro: Coroutine[Any, Any, T]) -> T:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, here))

        async def receive_there() -> Any:
            return await on_here(receive())

        async def send_there(message: Any) -> None:
            await on_here(send(message))

        try:
            there = asyncio.run_coroutine_threadsafe(
                self._app(scope, receive_there, send_there), self._loop
            )
        except RuntimeError:  # the serving loop is closed: shutting down
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await asyncio.wrap_future(there)  # cancelling this cancels the serving side


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without signal handlers: the process's stay ours (drain on SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpThread:
    """uvicorn serving ``config`` on a daemon thread with its own event loop."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._server = _EmbeddedUvicorn(config)
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="teacher-http", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()  # its own loop (uvicorn's loop factory), this thread
        except BaseException as e:  # SystemExit from uvicorn when the port is taken
            self._failure = e

    async def start(self) -> int:
        """Start the thread; return the bound port once it listens (raise if it failed)."""
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(
                    f"HTTP server failed to start on port {self._server.config.port}: "
                    f"{self._failure!r}"
                )
            await asyncio.sleep(0.02)
        sockets = [s for srv in self._server.servers for s in srv.sockets]
        return int(sockets[0].getsockname()[1]) if sockets else int(self._server.config.port)

    async def stop(self, timeout_s: float) -> None:
        """Ask uvicorn to close and wait up to ``timeout_s`` for the thread."""
        self._server.should_exit = True
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.warning("the HTTP thread did not stop within %.1f s", timeout_s)
