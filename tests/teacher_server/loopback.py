"""Test helper: a real ``TeacherServer`` on 127.0.0.1 (gRPC and HTTP on free ports) with its
serving loop in a thread of this process, for tests that drive the server from outside
its loop (a blocking gRPC stub, ``urllib``, a callback that holds the loop)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import grpc

from teacher_server.backends.base import Backend
from teacher_server.server import ServerConfig, TeacherServer
from topk_protocol import pb_grpc

__all__ = ["LoopbackTeacher"]


class LoopbackTeacher:
    """A ``TeacherServer`` on loopback serving ``backend``, ready when constructed.

    ``target``: its gRPC address; ``stub``: a blocking ``TeacherStub`` on it; ``http``:
    its HTTP base URL. :meth:`stop` drains it and ends the loop's thread."""

    def __init__(self, backend: Backend) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = ServerConfig(host="127.0.0.1", port=0, http_port=0, warmup=False, drain_timeout_s=1)
        self.server = TeacherServer(backend, cfg)
        self.call(self._start())
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.TeacherStub(self.channel)
        self.http = f"http://127.0.0.1:{self.server.http_port}"

    def call(self, coro: Any) -> Any:
        """Run ``coro`` on the serving loop and wait for its result (30 s at most)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> None:
        await self.server.start()
        await self.server.wait_ready(30)

    def get(self, path: str) -> tuple[int, bytes]:
        """HTTP GET ``path``: (status, body), error statuses included."""
        try:
            with urllib.request.urlopen(self.http + path, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def hold_loop(self, seconds: float, started: threading.Event) -> None:
        """Hold the serving loop for ``seconds``, GIL and all, from a callback on it
        (``started`` is set when the hold begins)."""

        def busy() -> None:
            started.set()
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        self.loop.call_soon_threadsafe(busy)

    def stop(self) -> None:
        self.channel.close()
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
