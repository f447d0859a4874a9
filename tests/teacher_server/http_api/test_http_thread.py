"""The probes are answered on the HTTP thread, not on the serving loop: while a flood of
tiny stream requests runs and the serving loop is held (a pure-Python busy stretch that
keeps the GIL, as a burst of work on the loop does), ``/healthz`` and ``/readyz`` keep
answering, each within a small share of the stall; the other routes still reach the
serving loop. A real ``TeacherServer`` on loopback with a trivial in-process backend."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.http_api.thread import probe_answer
from teacher_server.lifecycle import Lifecycle, Phase
from teacher_server.validation import ParsedSequence
from tests.teacher_server.loopback import LoopbackTeacher
from topk_protocol import RequestOptions, SequenceArrays, build_request, pb, pb_grpc

#: The serving loop is held this long, in one go, during the flood.
STALL_S = 5.0
#: Every probe sent while the loop is held answers within this share of the stall (a
#: probe served by the loop itself would wait for the stall's end: share ~1).
PROBE_SHARE_OF_STALL = 0.25
#: Requests of the flooding stream.
FLOOD = 2_000


class OneRowBackend(Backend):
    """Scores each position with ids ``0..k-1`` and log-probs ``-1..-k``, at once."""

    def __init__(self) -> None:
        self.info = BackendInfo("one-row", 512, "f" * 64, 64, 0, "one-row")
        self.alive = True

    def engine_alive(self) -> bool:
        return self.alive

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        n, k = sequence.end - sequence.start, options.top_k
        ids = np.tile(np.arange(k, dtype=np.int32), (n, 1))
        lps = np.tile(-np.arange(1, k + 1, dtype=np.float32), (n, 1))
        return SequenceArrays(ids, lps, np.full(n, np.nan, np.float32), sequence.start)


@pytest.fixture
def loopback() -> Iterator[LoopbackTeacher]:
    server = LoopbackTeacher(OneRowBackend())
    yield server
    server.stop()


def _tiny_requests(n: int) -> Iterator[pb.ScoreRequest]:
    for i in range(n):
        req = build_request([np.array([i % 512], np.int32)], 1)
        req.request_id = str(i)
        yield req


def test_probes_answer_while_a_flood_holds_the_serving_loop(loopback: LoopbackTeacher) -> None:
    answered: list[str] = []

    def flood() -> None:
        with grpc.insecure_channel(loopback.target) as ch:
            for msg in pb_grpc.TeacherStub(ch).ScoreStream(_tiny_requests(FLOOD), timeout=600):
                assert not msg.HasField("error"), msg.error
                if msg.final:
                    answered.append(msg.request_id)

    flooder = threading.Thread(target=flood)
    flooder.start()
    while not answered and flooder.is_alive():
        time.sleep(0.01)  # the flood is under way
    started = threading.Event()
    loopback.hold_loop(STALL_S, started)
    assert started.wait(30)
    t_stall = time.perf_counter()
    probes: list[tuple[str, int, float]] = []  # (path, status, seconds)
    while time.perf_counter() - t_stall < STALL_S:
        for path in ("/healthz", "/readyz"):
            t0 = time.perf_counter()
            status, _ = loopback.get(path)
            probes.append((path, status, time.perf_counter() - t0))
    flooder.join(600)
    during = probes
    slowest = max(s for _, _, s in during)
    print(f"{len(during)} probes while the loop was held {STALL_S} s; slowest {slowest:.3f} s")
    # Several probes answered within the stall, none waited for its end.
    assert len(during) >= 4, during
    assert slowest < PROBE_SHARE_OF_STALL * STALL_S, during
    # Ready throughout: a busy loop is no reason to turn unready.
    assert all(status == 200 for _, status, _ in during), during
    # The flood got every answer, in order.
    assert answered == [str(i) for i in range(FLOOD)]


def test_other_routes_still_reach_the_serving_loop(loopback: LoopbackTeacher) -> None:
    status, body = loopback.get("/metrics")
    assert status == 200 and b"# HELP" in body
    status, body = loopback.get("/v1/info")
    assert status == 200 and json.loads(body)["backend"] == "one-row"
    assert loopback.get("/no-such-route")[0] == 404


def test_readiness_turns_false_when_the_engine_is_lost(loopback: LoopbackTeacher) -> None:
    assert loopback.get("/readyz") == (200, b'{"status":"ready"}')
    backend = loopback.server._backend
    assert isinstance(backend, OneRowBackend)
    backend.alive = False
    assert loopback.get("/readyz") == (503, b'{"status":"engine_lost"}')
    assert loopback.get("/healthz")[0] == 200  # alive: the process answers


def test_probe_answers_follow_the_lifecycle() -> None:
    lifecycle = Lifecycle()
    assert probe_answer("/readyz", lifecycle, True) == (503, b'{"status":"loading"}')
    assert probe_answer("/healthz", lifecycle, False)[0] == 200
    asyncio.run(lifecycle.advance(Phase.READY))
    assert probe_answer("/readyz", lifecycle, True)[0] == 200
    asyncio.run(lifecycle.advance(Phase.DRAINING))
    assert probe_answer("/readyz", lifecycle, True) == (503, b'{"status":"draining"}')
    assert probe_answer("/healthz", lifecycle, True) == (
        200,
        b'{"status":"alive","phase":"draining"}',
    )
