"""Shared fixtures: a tiny model, and ONE real vLLM-backed teacher server per test session.

The server runs as a subprocess (``python -m teacher_server serve --backend vllm``) on
loopback ports; tests talk to it over real gRPC and HTTP.

Every test that starts a vLLM engine carries the ``vllm`` marker, so that
``pytest -m "not vllm"`` starts none. Enforced twice: a test that asks for a vLLM fixture
without the marker is a collection error, and while a test without the marker runs,
``NO_ENGINE_ENV`` is set, so any vLLM engine it starts (through a fixture, a server
subprocess, an example) refuses to start, naming the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis_profiles import load_profile

from devtools.launch import TeacherProcess, free_port, http_status, start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS
from teacher_server.backends.vllm.backend import NO_ENGINE_ENV

__all__ = ["ROOT", "ServerProcess", "free_port", "http_status", "start_server"]

ROOT = Path(__file__).resolve().parents[1]

# Shared with examples and benchmarks; re-exported under the names the tests use.
ServerProcess = TeacherProcess
start_server = start_teacher

# Every hypothesis test runs derandomized unless HYPOTHESIS_PROFILE=fuzz (hypothesis_profiles.py).
HYPOTHESIS_PROFILE = load_profile()

#: The shared fixtures that start a vLLM engine: a test that uses one needs the marker.
VLLM_FIXTURES = frozenset({"vllm_teacher"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("vllm") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            f"these tests use {sorted(VLLM_FIXTURES)} (a vLLM engine) without "
            f"@pytest.mark.vllm: {', '.join(unmarked)}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Set ``NO_ENGINE_ENV`` while a test without the ``vllm`` marker runs (its fixtures'
    set-up included): a vLLM engine it starts, in any process, refuses to."""
    if item.get_closest_marker("vllm") is not None:
        return (yield)
    before = os.environ.get(NO_ENGINE_ENV)
    os.environ[NO_ENGINE_ENV] = f"test {item.nodeid} has no @pytest.mark.vllm"
    try:
        return (yield)
    finally:
        if before is None:
            del os.environ[NO_ENGINE_ENV]
        else:
            os.environ[NO_ENGINE_ENV] = before


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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The session's S3-compatible server (moto's server mode on a loopback port): its
    endpoint URL, with credentials and ``AWS_ENDPOINT_URL`` set in the environment."""
    from object_store import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new empty bucket on the session's S3 server: ``s3://NAME``."""
    from object_store import make_bucket

    return make_bucket()
