"""Shared fixtures: a tiny model, and ONE real vLLM-backed teacher server per test session.

The server runs as a subprocess (``python -m teacher_server serve --backend vllm``) on
loopback ports; tests talk to it over real gRPC and HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.launch import TeacherProcess, free_port, http_status, start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS

__all__ = ["ROOT", "ServerProcess", "free_port", "http_status", "start_server"]

ROOT = Path(__file__).resolve().parents[1]

# Shared with examples and benchmarks; re-exported under the names the tests use.
ServerProcess = TeacherProcess
start_server = start_teacher


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model (vocab 512) with a byte-level tokenizer."""
    from devtools.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def vllm_teacher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The session's one vLLM-backed teacher server on the tiny model (float32 weights,
    max K 256, ``TINY_SERVE_ARGS``)."""
    log_path = tmp_path_factory.mktemp("vllm-teacher") / "server.log"
    server = start_server(
        ["--backend", "vllm", "--model", str(tiny_model_dir), *TINY_SERVE_ARGS],
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
