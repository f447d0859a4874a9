"""Fair turns for the engine's slots, end to end through the real gRPC server: four
streams flood a server of 2 slots (each stream keeps 16 requests open, so 62 wait), then
one more call arrives with one request. The freed slots go round per stream: the
newcomer reaches the backend after at most one request of each flooding stream, and the
flooding streams share the slots evenly; in arrival order (``--admission-order
arrival``) it would come after all 62. The backend holds every request until the test
opens its gate, and the verdict counts the order in which it saw them: no clock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.fair_share import ARRIVAL, FAIR
from teacher_server.server import ServerConfig, TeacherServer
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays, build_request, pb, pb_grpc

SLOTS = 2
STREAMS = 4
#: Requests each flooding stream sends (16 open at once: the default stream window).
PER_STREAM = 40
WINDOW = 16
#: The newcomer's token id (the flooding streams' are 0..STREAMS-1).
NEWCOMER = 100


class GatedBackend(Backend):
    """Once :attr:`holding` is set: records the first token id of each sequence it is
    asked to score, and holds it until :meth:`open` (from any thread). Before that
    (start-up's fingerprint) it answers at once."""

    def __init__(self) -> None:
        self.info = BackendInfo("gated", 512, "f" * 64, 64, 0, "gated")
        self.order: list[int] = []
        self.holding = False
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def engine_alive(self) -> bool:
        return True

    def open(self) -> None:
        assert self._loop is not None and self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        if self.holding:
            if self._gate is None:
                self._gate, self._loop = asyncio.Event(), asyncio.get_running_loop()
            self.order.append(int(sequence.token_ids[0]))
            await self._gate.wait()
        n, k = sequence.end - sequence.start, options.top_k
        ids = np.tile(np.arange(k, dtype=np.int32), (n, 1))
        lps = np.tile(-np.arange(1, k + 1, dtype=np.float32), (n, 1))
        return SequenceArrays(ids, lps, np.full(n, np.nan, np.float32), sequence.start)


def _wait_for(what: str, ok: object) -> None:
    """Wait for ``ok()``; the deadline only stops a broken run, it decides nothing."""
    end = time.monotonic() + 60
    while not ok():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _requests(token: int, n: int) -> Iterator[pb.ScoreRequest]:
    for i in range(n):
        req = build_request([np.array([token], np.int32)], 1)
        req.request_id = f"{token}-{i}"
        yield req


def _admission_order(order: str) -> list[int]:
    """The order the backend saw the flood's and the newcomer's requests in."""
    backend = GatedBackend()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        http_port=0,
        warmup=False,
        drain_timeout_s=1,
        max_inflight_requests=SLOTS,
        admission_order=order,
        stream_max_unsent_requests=WINDOW,
    )
    server = TeacherServer(backend, cfg)

    async def start() -> None:
        await server.start()
        await server.wait_ready(30)

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    target = f"127.0.0.1:{server.port}"
    answered: dict[int, list[str]] = {}

    def flood(token: int) -> None:
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.TeacherStub(ch)
            answers = stub.ScoreStream(_requests(token, PER_STREAM), timeout=120)
            answered[token] = [m.request_id for m in answers if m.final]

    def newcomer() -> None:
        with grpc.insecure_channel(target) as ch:
            pb_grpc.TeacherStub(ch).Score(next(_requests(NEWCOMER, 1)), timeout=120)
            answered[NEWCOMER] = ["done"]

    backend.holding = True
    try:
        threads = [threading.Thread(target=flood, args=(s,)) for s in range(STREAMS)]
        for t in threads:
            t.start()
        waiting = STREAMS * WINDOW - SLOTS
        _wait_for(f"{waiting} queued", lambda: server.queued == waiting)
        late = threading.Thread(target=newcomer)
        late.start()
        _wait_for("the newcomer queued", lambda: server.queued == waiting + 1)
        backend.open()
        for t in [*threads, late]:
            t.join(120)
        # Every request answered, none twice.
        assert sorted(answered) == [*range(STREAMS), NEWCOMER]
        for s in range(STREAMS):
            assert sorted(answered[s]) == sorted(f"{s}-{i}" for i in range(PER_STREAM))
        assert len(backend.order) == STREAMS * PER_STREAM + 1
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return backend.order


def test_a_newcomer_gets_a_slot_after_one_turn_of_each_flooding_stream() -> None:
    order = _admission_order(FAIR)
    # SLOTS were taken before it came; then at most one request per flooding stream.
    assert order.index(NEWCOMER) <= SLOTS + STREAMS
    # The flooding streams share the slots in turn: in the first 10 rounds after the
    # first SLOTS, each stream got 10 of the 40 turns (+-1 for where the round started).
    flood = [t for t in order[SLOTS:] if t != NEWCOMER][: STREAMS * 10]
    shares = Counter(flood)
    assert all(9 <= shares[s] <= 11 for s in range(STREAMS)), shares


@pytest.mark.parametrize("order", [ARRIVAL])
def test_in_arrival_order_the_newcomer_waits_behind_the_whole_flood(order: str) -> None:
    # The contrast that makes the test above mean something.
    assert _admission_order(order).index(NEWCOMER) == STREAMS * WINDOW
