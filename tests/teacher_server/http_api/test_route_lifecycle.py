"""The routes that answer other servers' calls (SGLang's ``/generate``, vLLM's
``/v1/completions`` and ``/inference/v1/generate``) keep the server's lifecycle and its
bearer token, each refusal in the route's own error shape: 503 while the engine loads,
401 without the token or with a wrong one, 503 once draining, while a request in flight
is still answered. A real ``TeacherServer`` on loopback (gRPC and HTTP, its loop in a
thread of this process) whose backend's load and scoring wait on events the test sets.
The error kinds and their statuses through every route: tests/teacher_server/test_pipeline.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.server import ServerConfig, TeacherServer
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays

VOCAB, TOKEN = 512, "s3cret"
HOLD = 7  # a sequence starting with this id is held until the test releases it


class HeldBackend(Backend):
    """Loads when ``loaded`` is set; answers zeros, holding a sequence that starts with
    :data:`HOLD` until ``release`` is set (both threading events)."""

    def __init__(self) -> None:
        self.info = BackendInfo("held", VOCAB, "h" * 64, 64, 0, "held")
        self.loaded = threading.Event()
        self.release = threading.Event()
        self.holding = threading.Event()

    async def start(self) -> None:
        while not self.loaded.is_set():
            await asyncio.sleep(0.01)

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        if int(sequence.token_ids[0]) == HOLD:
            self.holding.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        n, k = sequence.end - sequence.start, options.top_k
        return SequenceArrays(
            np.zeros((n, k), np.int32), np.full((n, k), -1.0, np.float32),
            np.full(n, -1.0, np.float32), sequence.start,
        )  # fmt: skip


def _generate(first: int) -> dict[str, Any]:
    return {"input_ids": [first, 1, 2], "return_logprob": True, "logprob_start_len": 0}


def _completions(first: int) -> dict[str, Any]:
    return {"prompt": [first, 1, 2], "max_tokens": 1, "prompt_logprobs": 4}


def _token_generate(first: int) -> dict[str, Any]:
    return {"token_ids": [first, 1, 2], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 4}}


def _nested(body: Any) -> str:
    return str(body["error"]["message"])


#: path, body for a sequence starting with ``first``, where its error shape holds the message.
ROUTES: list[tuple[str, Callable[[int], dict[str, Any]], Callable[[Any], str]]] = [
    ("/generate", _generate, _nested),
    ("/v1/completions", _completions, lambda body: str(body["error"])),
    ("/inference/v1/generate", _token_generate, _nested),
]


class Harness:
    """The server on loopback with its loop in a thread; started, not yet loaded."""

    def __init__(self) -> None:
        self.backend = HeldBackend()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = ServerConfig(
            host="127.0.0.1", port=0, http_port=0, warmup=False, drain_timeout_s=30, token=TOKEN
        )
        self.server = TeacherServer(self.backend, cfg)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.http = f"http://127.0.0.1:{self.server.http_port}"

    def post(self, path: str, body: dict[str, Any], token: str | None = TOKEN) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"{self.http}{path}", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_ready(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.wait_ready(30), self.loop).result(35)

    def stop(self) -> Any:
        return asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.backend.loaded.set()
    h.backend.release.set()
    h.stop().result(60)
    h.loop.call_soon_threadsafe(h.loop.stop)
    h.thread.join(10)


def test_loading_then_the_token_then_draining_in_each_routes_own_shape(harness: Harness) -> None:
    for path, make, message_of in ROUTES:
        status, body = harness.post(path, make(1))
        assert status == 503 and "loading" in message_of(body), (path, status, body)
    harness.backend.loaded.set()
    harness.wait_ready()
    for path, make, message_of in ROUTES:
        for token in (None, "wrong"):
            status, body = harness.post(path, make(1), token=token)
            assert status == 401, (path, token, status, body)
            assert message_of(body).startswith("authorization: "), (path, body)
        status, body = harness.post(path, make(1))
        assert status == 200, (path, status, body)
    # A request in flight when the drain begins is answered; new ones get 503.
    held: dict[str, tuple[int, Any]] = {}

    def send_held() -> None:
        held["r"] = harness.post("/generate", _generate(HOLD))

    thread = threading.Thread(target=send_held)
    thread.start()
    assert harness.backend.holding.wait(30)
    stopping = harness.stop()
    deadline = time.monotonic() + 10
    while harness.server.lifecycle.refusal() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    for path, make, message_of in ROUTES:
        status, body = harness.post(path, make(1))
        assert status == 503 and "shutting down" in message_of(body), (path, status, body)
    harness.backend.release.set()
    thread.join(30)
    status, body = held["r"]
    assert status == 200 and len(body["meta_info"]["input_token_logprobs"]) == 3
    stopping.result(60)
