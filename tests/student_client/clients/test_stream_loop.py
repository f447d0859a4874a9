"""``stream`` against a real gRPC teacher server (the project's ``TeacherServer`` on
loopback, in this process) whose engine is a deterministic stand-in: it answers after a
delay chosen by the first token, so requests complete out of order on purpose, and its
rows are a known function of the tokens, so every payload can be checked exactly."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch

from student_client.clients import window as window_mod
from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import TeacherClient
from student_client.data.alignment import PaddedLayout
from student_client.data.batch import ScoreBatch
from student_client.data.payload import TeacherPayload
from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.server import ServerConfig, TeacherServer
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays
from topk_protocol.errors import DeadlineExceededError, InvalidRequestError


class EchoBackend(Backend):
    """Row t of a sequence x: ids ``(x[t] + j) % 512``, log-probs ``-(j+1) - x[t]/1000``;
    the answer comes after ``x[0]`` milliseconds."""

    def __init__(self) -> None:
        self.info = BackendInfo("echo", 512, "f" * 64, 64, 0, "echo")
        self.received: list[tuple[float, int]] = []  # (time, x[0]) per sequence

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        token_ids = sequence.token_ids
        self.received.append((time.monotonic(), int(token_ids[0])))
        await asyncio.sleep(int(token_ids[0]) / 1000)
        return expected_rows(np.asarray(token_ids), options.top_k, sequence.start, sequence.end)


def expected_rows(x: npt.NDArray[np.int64], k: int, start: int, end: int) -> SequenceArrays:
    t = x[start:end].astype(np.int64)
    ids = ((t[:, None] + np.arange(k)[None, :]) % 512).astype(np.int32)
    lps = (-(np.arange(k)[None, :] + 1.0) - t[:, None] / 1000).astype(np.float32)
    nxt = np.append(x[start + 1 : end + 1], 0)[: end - start]
    sampled = (-nxt / 100).astype(np.float32)
    if end == len(x) and end > start:
        sampled[-1] = np.nan
    return SequenceArrays(ids, lps, sampled, start)


class InProcessTeacher:
    """A ``TeacherServer`` on 127.0.0.1 with its own event loop in a thread."""

    def __init__(self, backend: Backend, **config: object) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = ServerConfig(
            host="127.0.0.1",
            port=0,
            http_port=-1,
            warmup=False,
            drain_timeout_s=1,
            **config,  # type: ignore[arg-type]
        )
        self.server = TeacherServer(backend, cfg)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.target = f"127.0.0.1:{self.server.port}"

    async def _start(self) -> None:
        await self.server.start()
        await self.server.wait_ready(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def echo_teacher() -> Iterator[InProcessTeacher]:
    teacher = InProcessTeacher(EchoBackend(), chunk_kb=1)  # 1 KiB chunks: many per request
    yield teacher
    teacher.stop()


def check_payload(
    p: TeacherPayload, seqs: list[list[int]], spans: list[tuple[int, int]], k: int
) -> None:
    """The payload is exactly the echo rows of each sequence, padded."""
    s_max = max(e - s for s, e in spans)
    assert p.ids.shape == (len(seqs), s_max, k)
    for b, (x, (s, e)) in enumerate(zip(seqs, spans, strict=True)):
        want = expected_rows(np.asarray(x), k, s, e)
        n = e - s
        assert p.mask[b].tolist() == [True] * n + [False] * (s_max - n)
        assert int(p.position_start[b]) == s
        np.testing.assert_array_equal(p.ids[b, :n].numpy(), want.ids)
        np.testing.assert_array_equal(
            p.logprobs[b, :n].numpy(), torch.from_numpy(want.logprobs).half().float().numpy()
        )
        assert p.sampled_logprobs is not None
        np.testing.assert_array_equal(
            p.sampled_logprobs[b, :n].numpy(),
            torch.from_numpy(want.sampled_logprobs).half().float().numpy(),
        )


def make_batches(n: int, seed: int) -> list[tuple[list[list[int]], list[tuple[int, int]]]]:
    """Ragged batches whose first token sets the delay: later batches answer sooner."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        seqs = []
        spans = []
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(1, 80))
            x = rng.integers(0, 512, size=length).tolist()
            x[0] = 10 + 15 * (n - i) % 120  # delay in ms, decreasing with i
            seqs.append(x)
            s = int(rng.integers(0, length))
            spans.append(
                (s, int(rng.integers(s, length + 1))) if rng.random() < 0.5 else (0, length)
            )
        out.append((seqs, spans))
    return out


@pytest.fixture
def completion_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """request_ids in the order their answers completed (spy on the stream window)."""
    order: list[str] = []
    route = window_mod.StreamWindow.route

    def spy(self: window_mod.StreamWindow, msg: object) -> bool:
        done = route(self, msg)  # type: ignore[arg-type]
        if done:
            order.append(msg.request_id)  # type: ignore[attr-defined]
        return done

    monkeypatch.setattr(window_mod.StreamWindow, "route", spy)
    return order


@pytest.mark.parametrize("depth", [0, 1, 8])
def test_stream_yields_in_input_order(
    echo_teacher: InProcessTeacher, completion_order: list[str], depth: int
) -> None:
    batches = make_batches(12, seed=depth)
    k = 8
    with TeacherClient(echo_teacher.target) as client:
        items = [ScoreBatch(seqs, spans) for seqs, spans in batches]
        payloads = list(client.stream(items, k, depth=depth))
    assert len(payloads) == len(batches)
    for p, (seqs, spans) in zip(payloads, batches, strict=True):
        check_payload(p, seqs, spans, k)
    ids = [int(p.request_id.rsplit("-", 1)[1]) for p in payloads]
    assert ids == sorted(ids)
    arrival = [int(r.rsplit("-", 1)[1]) for r in completion_order]
    if depth >= 2:
        assert arrival != sorted(arrival), "the teacher answered in order: reordering untested"
    else:
        assert arrival == sorted(arrival)


def test_stream_deadline_per_request(echo_teacher: InProcessTeacher) -> None:
    """Each request of a stream has its own deadline: the slow one (answered after 400 ms)
    fails at its 0.15 s, well before its answer would have come (timed here, the same
    stream without a deadline: the baseline); the fast one arrives."""
    with TeacherClient(echo_teacher.target) as client:
        fast = [[5, 1, 2]]
        slow = [[400, 1, 2]]  # answers after 400 ms
        t0 = time.monotonic()
        assert [p.ids.shape for p in client.stream([fast, slow], 4, depth=2)] == [(1, 3, 4)] * 2
        answered_s = time.monotonic() - t0
        t0 = time.monotonic()
        it = client.stream([fast, slow], 4, depth=2, timeout_s=0.15)
        assert next(it).ids.shape == (1, 3, 4)
        with pytest.raises(DeadlineExceededError, match=r"timeout_s 0\.15"):
            next(it)
        failed_s = time.monotonic() - t0
    # 0.15 s against 0.4 s is 3/8; 3/4 leaves each run up to 0.6 s of overhead.
    assert failed_s < 0.75 * answered_s, (failed_s, answered_s)


def test_stream_error_arrives_at_its_batch(echo_teacher: InProcessTeacher) -> None:
    """An invalid batch (server-side: K too large; client-side: not a batch) fails when
    the caller reaches it; the batches before it arrive."""
    with TeacherClient(echo_teacher.target) as client:
        it = client.stream([[[5, 6]], [[7, 8, 9]], [[5, 600]]], 4, depth=3)
        assert next(it).ids.shape == (1, 2, 4)
        assert next(it).ids.shape == (1, 3, 4)
        with pytest.raises(InvalidRequestError, match=r"token_ids\[1\]: 600 is outside"):
            next(it)
        it = client.stream([[[5, 6]], [1, 2, 3]], 4, depth=3)
        assert next(it).ids.shape == (1, 2, 4)
        with pytest.raises(InvalidRequestError, match="flat list"):
            next(it)


def test_async_stream_yields_in_input_order(
    echo_teacher: InProcessTeacher, completion_order: list[str]
) -> None:
    batches = make_batches(10, seed=7)
    k = 5

    async def batch_source() -> AsyncIterator[ScoreBatch]:
        for seqs, spans in batches:
            await asyncio.sleep(0)
            yield ScoreBatch(seqs, spans)

    async def run() -> list[TeacherPayload]:
        async with AsyncTeacherClient(echo_teacher.target) as client:
            info = await client.info()
            assert info.backend == "echo"
            single = await client.score(batches[0][0], k, positions=batches[0][1])
            check_payload(single, *batches[0], k)
            return [p async for p in client.stream(batch_source(), k, depth=6)]

    payloads = asyncio.run(run())
    for p, (seqs, spans) in zip(payloads, batches, strict=True):
        check_payload(p, seqs, spans, k)
    arrival = [int(r.rsplit("-", 1)[1]) for r in completion_order]
    assert arrival != sorted(arrival)


def test_async_errors(echo_teacher: InProcessTeacher) -> None:
    async def run() -> None:
        async with AsyncTeacherClient(echo_teacher.target) as client:
            it = client.stream([[[5, 6]], [[5, 600]]], 4, depth=2)
            assert (await anext(it)).ids.shape == (1, 2, 4)
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await anext(it)
            with pytest.raises(DeadlineExceededError):
                await client.score([[300, 1]], 4, timeout_s=0.05)
            it = client.stream([[[300, 1]]], 4, timeout_s=0.05)
            with pytest.raises(DeadlineExceededError):
                await anext(it)

    asyncio.run(run())


def _live_layouts() -> int:
    gc.collect()
    return sum(type(o) is PaddedLayout for o in gc.get_objects())


def test_failed_stream_keeps_no_padded_layout(echo_teacher: InProcessTeacher) -> None:
    """A padded batch's layout travels with its answer: when a stream fails before the
    answers are decoded (a refused batch, a deadline), nothing of it stays behind in the
    client, however many streams fail."""
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])

    def padded(first: int, bad: bool = False) -> ScoreBatch:
        ids = np.array([[first, 6, 7, 0], [0, first, 600 if bad else 8, 9]])
        return ScoreBatch({"input_ids": ids, "attention_mask": mask})

    before = _live_layouts()

    async def run() -> None:
        async with AsyncTeacherClient(echo_teacher.target) as client:
            for _ in range(3):
                # Batch 1 is refused while batches 2 and 3 are in flight, undecoded.
                it = client.stream([padded(5), padded(5, bad=True), padded(80), padded(90)], 4)
                assert (await anext(it)).ids.shape == (2, 4, 4)
                with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                    await anext(it)
                await it.aclose()  # type: ignore[attr-defined]
                with pytest.raises(DeadlineExceededError):
                    await client.score(padded(300).sequences, 4, timeout_s=0.05)
            assert _live_layouts() == before

    asyncio.run(run())
    assert _live_layouts() == before
