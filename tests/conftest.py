"""Shared fixtures: a tiny model, and ONE real vLLM-backed teacher server per test session.

The server runs as a subprocess (``python -m teacher_server serve --backend vllm``) on
loopback ports; tests talk to it over real gRPC and HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A ``teacher-server serve`` subprocess on loopback."""

    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def start_server(
    args: list[str],
    log_path: Path,
    *,
    ready_timeout: float = 300,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``python -m teacher_server serve ARGS`` and wait until ``/readyz`` says 200."""
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "teacher_server",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        *args,
    ]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the subprocess
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    server = ServerProcess(proc, port, http_port, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"teacher-server exited with {proc.returncode}:\n{server.log()[-4000:]}"
            )
        with contextlib.suppress(OSError):
            if http_status(f"{server.http}/readyz") == 200:
                return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"teacher-server not ready after {ready_timeout} s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model (vocab 512) with a byte-level tokenizer."""
    from teacher_server.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def vllm_teacher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The session's one vLLM-backed teacher server (float32 weights, max K 64)."""
    log_path = tmp_path_factory.mktemp("vllm-teacher") / "server.log"
    server = start_server(
        [
            "--backend",
            "vllm",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--max-top-k",
            "256",
            "--max-model-len",
            "4096",
            "--max-num-batched-tokens",
            "16384",
            "--max-tokens-per-request",
            "65536",
        ],
        log_path,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference_backend(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """In-process transformers backend on the same weights: the reference."""
    import asyncio

    from teacher_server.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(tiny_model_dir, max_top_k=256, dtype="float32")
    asyncio.run(backend.start())
    return backend


@pytest.fixture
def teacher_factory(tmp_path: Path) -> Iterator[object]:
    """``start(args) -> ServerProcess``: start extra servers (e.g. ``--backend transformers``);
    every one still running is stopped after the test."""
    started: list[ServerProcess] = []

    def start(args: list[str], **kwargs: object) -> ServerProcess:
        server = start_server(args, tmp_path / f"server-{len(started)}.log", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
