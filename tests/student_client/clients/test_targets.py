"""Several teachers: round robin over a target list, and a teacher killed (SIGKILL) in the
middle of a stream: every batch arrives exactly once, in order, from the survivor."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server
from test_aio import requests_ok

from student_client.clients import window as window_mod
from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import TeacherClient
from student_client.data.payload import TeacherPayload

K = 4
N_BATCHES = 16


@pytest.fixture(scope="module")
def three_teachers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    tmp = tmp_path_factory.mktemp("failover")
    args = ["--backend", "transformers", "--model", str(tiny_model_dir), "--max-top-k", "16"]
    servers = [start_server(args, tmp / f"server-{i}.log") for i in range(3)]
    yield servers
    for s in servers:
        s.stop()


def _batches(seed: int) -> list[list[np.ndarray]]:
    """Batches heavy enough (2 x 300-600 tokens) that the teacher is the bottleneck: the
    stream's window is full of unanswered requests when the teacher dies."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, 512, size=int(rng.integers(300, 600))) for _ in range(2)]
        for _ in range(N_BATCHES)
    ]


@pytest.fixture
def resent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many requests each (re)connection of a stream sent again (spy)."""
    counts: list[int] = []
    unanswered = window_mod.StreamWindow.unanswered

    def spy(self: window_mod.StreamWindow) -> list[object]:
        out = unanswered(self)
        counts.append(len(out))
        return out  # type: ignore[return-value]

    monkeypatch.setattr(window_mod.StreamWindow, "unanswered", spy)
    return counts


def _check_all(
    payloads: list[TeacherPayload], batches: list[list[np.ndarray]], survivor: ServerProcess
) -> None:
    """Exactly one payload per batch, in order, each the right one (not a neighbour's):
    equal to what the survivor answers for that batch in a stream without failures."""
    assert len(payloads) == len(batches)
    assert len({p.request_id for p in payloads}) == len(batches)
    with TeacherClient(survivor.target) as client:
        expected = list(client.stream(batches, K, depth=8))
    for p, e, batch in zip(payloads, expected, batches, strict=True):
        assert torch.equal(p.ids, e.ids) and torch.equal(p.logprobs, e.logprobs)
        assert p.mask.sum(dim=1).tolist() == [len(x) for x in batch]


def _kill(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)


def test_round_robin_then_sigkill_mid_stream(
    three_teachers: list[ServerProcess], resent: list[int]
) -> None:
    a, b, _ = three_teachers
    with TeacherClient([a.target, b.target], backoff_s=0.05) as client:
        # Round robin: unary calls alternate between the two.
        before = [requests_ok(s, "Score") for s in (a, b)]
        for _ in range(4):
            client.score([[1, 2, 3]], K)
        assert [requests_ok(s, "Score") - n for s, n in zip((a, b), before, strict=True)] == [2, 2]

        batches = _batches(0)
        payloads: list[TeacherPayload] = []
        victim: ServerProcess | None = None
        stream_ok = {s.target: requests_ok(s, "ScoreStream") for s in (a, b)}
        for i, p in enumerate(client.stream(batches, K, depth=4)):
            payloads.append(p)
            if i == 5:  # requests 6..9 are with the victim now
                victim = a if client.current_target == a.target else b
                _kill(victim)
        assert victim is not None
        survivor = b if victim is a else a
        assert client.current_target == survivor.target
    # Requests 10..15 were never sent to the victim; 6..9 went to the survivor unless the
    # victim had answered them before it died.
    by_survivor = requests_ok(survivor, "ScoreStream") - stream_ok[survivor.target]
    assert N_BATCHES - 10 <= by_survivor <= N_BATCHES - 6
    assert resent[0] == 0 and sum(resent) >= 1  # unanswered requests were sent again
    _check_all(payloads, batches, survivor)


def test_async_client_survives_sigkill(
    three_teachers: list[ServerProcess], resent: list[int]
) -> None:
    alive = [s for s in three_teachers if s.proc.poll() is None]
    assert len(alive) >= 2
    first, second = alive[:2]
    batches = _batches(1)

    async def run() -> tuple[list[TeacherPayload], ServerProcess]:
        out: list[TeacherPayload] = []
        victim = None
        async with AsyncTeacherClient([first.target, second.target], backoff_s=0.05) as client:
            async for p in client.stream(batches, K, depth=3):
                out.append(p)
                if len(out) == 4:
                    victim = first if client.current_target == first.target else second
                    _kill(victim)
            assert victim is not None
            assert client.current_target != victim.target
        return out, victim

    payloads, victim = asyncio.run(run())
    assert victim.proc.poll() is not None
    assert resent[0] == 0 and sum(resent) >= 1
    _check_all(payloads, batches, second if victim is first else first)
