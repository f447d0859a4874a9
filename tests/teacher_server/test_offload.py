"""The event-loop helpers: bounded gathering (order, concurrency, errors) and the
thread hand-off of large requests."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from teacher_server import offload
from teacher_server.offload import MAX_SEQUENCES_IN_FLIGHT, gather_bounded, parse_off_loop
from teacher_server.validation import Limits, parse_request
from topk_protocol import build_request


def test_gather_bounded_keeps_order_and_the_concurrency_limit() -> None:
    running = peak = 0

    async def one(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (x % 5))
        running -= 1
        return 2 * x

    n = 3 * MAX_SEQUENCES_IN_FLIGHT + 7
    assert asyncio.run(gather_bounded(one, list(range(n)))) == [2 * x for x in range(n)]
    assert peak == MAX_SEQUENCES_IN_FLIGHT


def test_gather_bounded_raises_the_first_error_and_cancels_the_rest() -> None:
    started = 0

    async def one(x: int) -> int:
        nonlocal started
        started += 1
        if x == 3:
            raise ValueError("sequence 3 failed")
        await asyncio.sleep(0.01)
        return x

    with pytest.raises(ValueError, match="sequence 3 failed"):
        asyncio.run(gather_bounded(one, list(range(5 * MAX_SEQUENCES_IN_FLIGHT))))
    assert started < 5 * MAX_SEQUENCES_IN_FLIGHT  # the rest were not started


def test_large_requests_are_validated_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def spy(*args: object) -> object:
        seen.append(threading.current_thread().name)
        return parse_request(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(offload, "parse_request", spy)
    limits = Limits(vocab_size=512)
    small = build_request([np.arange(4, dtype=np.int32)], 4)
    large = build_request([np.arange(1, dtype=np.int32)] * 1000, 4)
    asyncio.run(parse_off_loop(small, limits))
    asyncio.run(parse_off_loop(large, limits))
    assert seen[0] == "MainThread" and seen[1] != "MainThread"
