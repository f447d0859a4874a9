"""Per-stream backpressure: the budget itself (asyncio), and two clients that stop reading
their ScoreStream on the real vLLM teacher: bounded memory, nothing more scored for them,
another client not delayed, memory back once they go."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

from student_client.clients.blocking import TeacherClient
from teacher_server.grpc_api.backpressure import (
    DEFAULT_STREAM_MAX_UNSENT_MB,
    DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
    StreamBudget,
)
from tests.conftest import ROOT
from topk_protocol import build_request, pb, pb_grpc

MIB = 1024 * 1024


def test_budget_waits_for_requests_and_bytes_and_lets_one_large_answer_through() -> None:
    async def main() -> None:
        b = StreamBudget(max_requests=2, max_bytes=100)
        await b.take_request()
        await b.take_request()
        third = asyncio.create_task(b.take_request())
        await asyncio.sleep(0.01)
        assert not third.done()  # two requests unsent: the third is not read
        await b.take_bytes(500)  # alone: larger than the budget, still goes
        more = asyncio.create_task(b.take_bytes(1))
        await asyncio.sleep(0.01)
        assert not more.done() and not third.done()
        await b.give_back(500)
        await asyncio.wait_for(asyncio.gather(third, more), 1)
        assert (b.requests, b.bytes) == (2, 1)

    asyncio.run(main())


def test_budget_refuses_bad_values_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="stream_max_unsent_requests: must be >= 1"):
        StreamBudget(0, 1)
    with pytest.raises(ValueError, match="stream_max_unsent_bytes: must be >= 1"):
        StreamBudget(1, 0)


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def _stream_requests_scored(http: str) -> float:
    """ScoreStream requests answered so far, from /metrics (all codes)."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    pattern = r'topk_teacher_requests_total\{code="[A-Z_]+",method="ScoreStream"\} ([0-9.e+]+)'
    return sum(float(v) for v in re.findall(pattern, text))


def _shared_row_bytes(http: str) -> float:
    """Bytes of answers' rows the server keeps to share (a cache of its own, bounded by
    ``--shared-rows-mib``: not what slow readers hold), from /metrics."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    found = re.search(r"^topk_teacher_shared_rows_bytes ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _p99_latency_s(client: TeacherClient, tokens: np.ndarray, n: int = 40) -> float:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.score([tokens], 16)
        lat.append(time.perf_counter() - t0)
    return float(np.percentile(lat, 99))


def _big_requests(n: int, seed: int) -> Iterator[pb.ScoreRequest]:
    """n requests of 8 x 256 tokens at K = 64, float32: about 1 MiB of answer each."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        seqs = [rng.integers(0, 512, 256).astype(np.int32) for _ in range(8)]
        req = build_request(seqs, 64, dtype="float32")
        req.request_id = f"slow-{seed}-{i}"
        yield req


@pytest.mark.vllm
def test_two_clients_that_stop_reading_hold_bounded_memory_and_delay_no_one(
    vllm_teacher,  # type: ignore[no-untyped-def]
) -> None:
    """The issue's slow reader: 2 clients send 200 ScoreStream requests of ~1 MiB of answer
    each (400 MiB in all) and read nothing. Bound: from its size after serving answers of
    that size once, the server process grows by at most 2 x (8 MiB budget + one 1 MiB
    answer) plus gRPC's buffers and allocator slack: 48 MiB, besides the rows the server
    keeps to share with later requests for the same prefix (a cache of its own, bounded by
    ``--shared-rows-mib``, its size on /metrics); another client's p99 latency stays within
    2x its baseline (the worse of the baselines measured before and after, in this run); 30
    s after they go, RSS is within 50 MiB of where it started."""
    server = vllm_teacher
    pid = server.proc.pid
    tokens = np.random.default_rng(0).integers(0, 512, 64).astype(np.int32)
    with TeacherClient(server.target) as good:
        base_before = _p99_latency_s(good, tokens)
        # The baseline is taken after the server has built and sent answers of this size
        # once (read in full): what first use allocates (buffers grown to 1 MiB answers,
        # gRPC's send path) is not what a stalled stream holds.
        with grpc.insecure_channel(server.target) as ch:
            warm = pb_grpc.TeacherStub(ch).ScoreStream(_big_requests(4, seed=99))
            assert {a.request_id for a in warm} == {f"slow-99-{i}" for i in range(4)}
        rss0 = _rss(pid)
        kept0 = kept = _shared_row_bytes(server.http)
        scored0 = _stream_requests_scored(server.http)
        # A fixed transport window (no BDP probing, which would grow it to several MiB while
        # the reader is idle): what the server sends past its own budget is then bounded by
        # that window, not by how long gRPC had to probe.
        channels = [
            grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)])
            for _ in range(2)
        ]
        calls = [
            pb_grpc.TeacherStub(ch).ScoreStream(_big_requests(200, seed=i))
            for i, ch in enumerate(channels)
        ]  # never read: their answers pile up on the server, up to the budget
        # Let the slow streams fill their budgets and stall.
        peak = rss0
        deadline = time.monotonic() + 180  # a safety stop: on a loaded machine it takes long
        last, still_since, stalled = -1.0, time.monotonic(), False
        while time.monotonic() < deadline:
            time.sleep(0.5)
            peak = max(peak, _rss(pid))
            kept = max(kept, _shared_row_bytes(server.http))
            scored = _stream_requests_scored(server.http) - scored0
            if scored != last:
                last, still_since = scored, time.monotonic()
            elif time.monotonic() - still_since > 3:
                stalled = True  # nothing scored for 3 s: both streams wait for their readers
                break
        assert stalled, f"the slow streams were still being scored after 180 s ({last:.0f})"
        during = _p99_latency_s(good, tokens)
        peak = max(peak, _rss(pid))
        stalled_scored = _stream_requests_scored(server.http) - scored0
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
        t_gone = time.monotonic()
        rss_after = _rss(pid)
        while time.monotonic() - t_gone < 30 and rss_after > rss0 + 50 * MIB:
            time.sleep(1)
            rss_after = _rss(pid)
        base_after = _p99_latency_s(good, tokens)
    baseline = max(base_before, base_after)
    shared = (kept - kept0) / MIB  # rows kept to share: counted apart, in /metrics
    growth = (peak - rss0) / MIB - shared
    print(
        f"slow readers: {stalled_scored:.0f} of 400 requests scored before they stalled; RSS "
        f"+{growth:.1f} MiB peak besides +{shared:.1f} MiB of shared rows, "
        f"+{(rss_after - rss0) / MIB:.1f} MiB "
        f"{time.monotonic() - t_gone:.0f} s after they went; good client p99 "
        f"{during * 1e3:.1f} ms vs baseline {base_before * 1e3:.1f} / {base_after * 1e3:.1f} ms"
    )
    per_stream = DEFAULT_STREAM_MAX_UNSENT_REQUESTS + 2  # + the one being read, + in flight
    assert stalled_scored <= 2 * per_stream, "a stream that stops reading must stop being scored"
    budget = f"budget {DEFAULT_STREAM_MAX_UNSENT_MB} MiB per stream"
    assert growth <= 48, f"RSS grew {growth:.1f} MiB (bound 48; {budget})"
    assert during <= 2 * baseline, f"p99 {during:.3f} s vs baseline {baseline:.3f} s"
    assert rss_after <= rss0 + 50 * MIB


@pytest.mark.vllm
def test_a_stalled_stream_resumes_when_its_client_reads(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    """Backpressure only pauses: once the client reads, every answer arrives, in full."""
    with grpc.insecure_channel(vllm_teacher.target) as ch:
        reqs = list(_big_requests(40, seed=7))
        it = pb_grpc.TeacherStub(ch).ScoreStream(iter(reqs))
        time.sleep(3)  # the stream stalls with the budget full
        finals: set[str] = set()
        got: dict[str, int] = {}

        def read() -> None:
            for msg in it:
                assert not msg.HasField("error"), msg.error
                got[msg.request_id] = got.get(msg.request_id, 0) + sum(
                    len(s.ids) for s in msg.sequences
                )
                if msg.final:
                    finals.add(msg.request_id)
                    if len(finals) == len(reqs):
                        return

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(120)
        assert len(finals) == len(reqs)
        assert all(n == 8 * 256 * 64 * 4 for n in got.values())  # ids bytes: 8 x 256 x K x 4


#: A client that opens a ScoreStream, sends its requests and never reads an answer,
#: until it is killed: ARGV target, seed.
_NEVER_READS = """
import sys, time
import numpy as np, grpc
from topk_protocol import build_request, pb_grpc
target, seed = sys.argv[1], int(sys.argv[2])
def requests():
    rng = np.random.default_rng(seed)
    for _ in range(60):
        yield build_request([rng.integers(0, 512, 256).astype(np.int32) for _ in range(8)], 64,
                            dtype="float32")
channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
call = pb_grpc.TeacherStub(channel).ScoreStream(requests())
print("sent", flush=True)
while True:
    time.sleep(60)
"""


def _stream_state(http: str) -> tuple[float, float]:
    """(streams whose state is alive, their unsent bytes) from /metrics."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    found = [
        re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        for name in ("topk_teacher_streams_open", "topk_teacher_stream_unsent_bytes")
    ]
    assert all(found), "the stream gauges are on /metrics"
    return float(found[0].group(1)), float(found[1].group(1))  # type: ignore[union-attr]


def _wait_for(condition: Any, what: str, safety_s: float = 300.0) -> None:
    """Poll until ``condition()``; ``safety_s`` only stops a hung run (not a measured bound)."""
    deadline = time.monotonic() + safety_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)


def _message_queue_bytes(server_pid: int) -> int:
    """Bytes of shared memory that hold pages in vLLM's message queues between its engine
    core and its worker: the ``/dev/shm`` files the worker (the server's largest
    descendant) maps, each counted once."""
    worker = max(
        psutil.Process(server_pid).children(recursive=True), key=lambda c: c.memory_info().rss
    )
    files = {
        line.split()[-1]
        for line in Path(f"/proc/{worker.pid}/maps").read_text().splitlines()
        if "/dev/shm/" in line
    }
    return sum(os.stat(f).st_blocks * 512 for f in files if os.path.exists(f))


#: What vLLM's message queues may hold once trimmed: the pages of the trim's own call and
#: answer (a chunk each: the one message not yet read when the trim ran), with room.
QUEUES_TRIMMED_BYTES = 256 * 1024


@pytest.mark.vllm
def test_a_killed_slow_reader_leaves_no_stream_state_behind(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    """A client that sends requests and reads nothing is SIGKILLed with answers waiting for
    it: the server lets go of its stream's state (the budget, the answers reserved and not
    sent; counted by the objects still alive, ``topk_teacher_streams_open``) and of those
    bytes (``topk_teacher_stream_unsent_bytes``), and keeps serving. Once it is quiet, the
    pages the stream's answers left in vLLM's shared-memory message queues go too
    (``teacher_server.backends.vllm.message_queue_pages``)."""
    server = vllm_teacher
    _wait_for(lambda: _stream_state(server.http) == (0.0, 0.0), "no stream open before")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = subprocess.Popen(
        [sys.executable, "-c", _NEVER_READS, server.target, "11"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "sent"
        _wait_for(
            lambda: _stream_state(server.http)[0] == 1 and _stream_state(server.http)[1] > 0,
            "the slow stream holds answers its client has not read",
        )
        assert _message_queue_bytes(server.proc.pid) > 4 * QUEUES_TRIMMED_BYTES
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    _wait_for(lambda: _stream_state(server.http) == (0.0, 0.0), "the stream's state released")
    _wait_for(
        lambda: _message_queue_bytes(server.proc.pid) <= QUEUES_TRIMMED_BYTES,
        "the message queues' pages given back once quiet",
    )
    with TeacherClient(server.target) as good:
        tokens = np.random.default_rng(0).integers(0, 512, 64).astype(np.int32)
        assert good.score([tokens], 16).ids.shape[-1] == 16
