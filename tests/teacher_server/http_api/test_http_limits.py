"""HTTP request limits on a real server process (replay backend: no engine to load): a
request head over the limit gets 431, a body over it 413, a head that trickles in is cut
off, and the server keeps serving."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from recording_fakes import INFO, K, teacher_answer

from teacher_server.config import HttpLimits
from teacher_server.http_api.limits import BodyLimitMiddleware
from topk_protocol.recording import RecordingWriter

#: The server's ``--http-header-timeout-s`` in these tests.
HEADER_TIMEOUT_S = 1


def _exchange(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes
    (or ``timeout_s``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        # The server may close while we are still sending: then read what it said.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


@pytest.fixture
def replay_server(tmp_path: Path, teacher_factory: Callable[..., Any]) -> Any:
    path = tmp_path / "rec"
    tokens, s = teacher_answer(8, seed=0)
    with RecordingWriter(path, INFO, top_k=K, dtype="float32") as w:
        w.add(tokens, s, dtype="float32")
    return teacher_factory(
        [
            "--backend",
            "replay",
            "--recording",
            str(path),
            "--http-max-header-kb",
            "16",
            "--http-max-body-mb",
            "1",
            "--http-header-timeout-s",
            str(HEADER_TIMEOUT_S),
        ]
    )


def test_a_header_over_the_limit_gets_431_and_the_server_keeps_serving(
    replay_server: Any,
) -> None:
    port = replay_server.http_port
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
    answer = _exchange(port, big)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    # Just under the limit is served; so is everything after the refusal.
    ok = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (15 * 1024) + b"\r\n\r\n"
    assert _exchange(port, ok + b"")[:12] == b"HTTP/1.1 200"
    for path in ("/healthz", "/readyz", "/metrics"):
        assert replay_server.http_status(path) == 200


def test_a_body_over_the_limit_gets_413(replay_server: Any) -> None:
    port = replay_server.http_port
    declared = b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"
    answer = _exchange(port, declared)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"exceeds the limit of 1048576" in answer
    assert replay_server.http_status("/healthz") == 200


def test_the_body_limit_counts_chunks_as_they_arrive_on_every_route() -> None:
    """A route that reads its body (as POST routes do) behind the middleware: a chunked
    body (no length declared) over the limit is 413, one under it is served."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    client = TestClient(BodyLimitMiddleware(app, max_body_bytes=100_000, body_timeout_s=5))

    def chunks(n: int) -> Any:
        for _ in range(n):
            yield b"c" * 10_000

    assert client.post("/echo", content=chunks(5)).json() == {"bytes": 50_000}
    refused = client.post("/echo", content=chunks(20))
    assert refused.status_code == 413 and "exceeds the limit of 100000" in refused.text
    assert client.post("/echo", content=b"x" * 200_000).status_code == 413  # declared


def test_a_request_head_that_trickles_in_is_cut_off(replay_server: Any) -> None:
    port = replay_server.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 8 * HEADER_TIMEOUT_S:  # a stop: trickle no longer
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.3)
            try:
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        elapsed = time.monotonic() - t0
    # Cut off by the header timeout (the loop above would trickle on for 8 times it):
    # within a few times the timeout, whatever else the machine is doing.
    assert closed, f"still open after {elapsed:.1f} s (header timeout {HEADER_TIMEOUT_S} s)"
    assert elapsed < 5 * HEADER_TIMEOUT_S, f"closed after {elapsed:.1f} s"
    assert replay_server.http_status("/healthz") == 200


def test_limits_refuse_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_header_bytes: must be >= 1"):
        HttpLimits(max_header_bytes=0)
    with pytest.raises(ValueError, match="body_timeout_s: must be > 0"):
        HttpLimits(body_timeout_s=0)
