"""The bounded admission queue: slots, a line taken in turn per stream, refusal when full
or closed, and callers that give up while waiting."""

from __future__ import annotations

import asyncio

import pytest

from teacher_server.admission import AdmissionQueue, AdmissionRefused


def test_slots_line_and_refusal() -> None:
    async def main() -> None:
        loads: list[tuple[int, int]] = []
        q = AdmissionQueue(2, 2, lambda f, w: loads.append((f, w)))
        await q.acquire()
        await q.acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            await q.acquire()
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert (q.in_flight, q.queued) == (2, 2)
        with pytest.raises(AdmissionRefused) as err:
            await q.acquire()
        assert "max_inflight_requests 2 + max_queued_requests 2" in err.value.message
        q.release()
        q.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1]  # two unary calls: two streams, in turn
        assert (q.in_flight, q.queued) == (2, 0)
        assert loads[-1] == (2, 0)
        q.release()
        q.release()
        await asyncio.wait_for(q.wait_idle(), 1)

    asyncio.run(main())


def test_close_refuses_waiters_and_later_calls_but_keeps_slots() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, 4)
        await q.acquire()
        waiting = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        q.close("teacher: shutting down; retry elsewhere")
        with pytest.raises(AdmissionRefused, match="shutting down"):
            await waiting
        with pytest.raises(AdmissionRefused, match="shutting down"):
            await q.acquire()
        assert q.in_flight == 1  # the request working keeps its slot
        idle = asyncio.create_task(q.wait_idle())
        await asyncio.sleep(0)
        assert not idle.done()
        q.release()
        await asyncio.wait_for(idle, 1)

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_line_and_loses_no_slot() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, 4)
        await q.acquire()
        first = asyncio.create_task(q.acquire())
        second = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        assert q.queued == 1
        q.release()  # goes to `second`, not to the cancelled one
        await asyncio.wait_for(second, 1)
        assert q.in_flight == 1
        # Handed a slot and cancelled in the same moment: the slot is passed on.
        third = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        q.release()
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        assert (q.in_flight, q.queued) == (0, 0)

    asyncio.run(main())


def test_bad_limits_name_the_flag() -> None:
    with pytest.raises(ValueError, match="max_inflight_requests"):
        AdmissionQueue(0, 1)
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionQueue(1, -1)


def test_full_queue_answers_unavailable_and_the_client_retries(  # type: ignore[no-untyped-def]
    teacher_factory, tiny_model_dir
) -> None:
    """Live (transformers backend, one request at a time): beyond the in-flight slot and
    the queue a request gets UNAVAILABLE naming both limits; a token-limit refusal stays
    RESOURCE_EXHAUSTED; TeacherClient retries the overload refusals with backoff and every
    batch comes back equal to the one computed alone."""
    import concurrent.futures

    import grpc
    import numpy as np
    import torch

    from student_client.clients.blocking import TeacherClient
    from topk_protocol import encode_token_ids, pb, pb_grpc
    from topk_protocol.errors import ResourceExhaustedError

    server = teacher_factory(
        [
            "--backend", "transformers", "--model", str(tiny_model_dir),
            "--max-inflight-requests", "1", "--max-queued-requests", "2",
            "--max-tokens-per-request", "4000",
        ]
    )  # fmt: skip
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, 3000) for _ in range(8)]
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        futures = [
            stub.Score.future(
                pb.ScoreRequest(
                    request_id=f"r{i}",
                    top_k=4,
                    sequences=[pb.SequenceRequest(token_ids=encode_token_ids(s))],
                ),
                timeout=120,
            )
            for i, s in enumerate(seqs)
        ]
        refused = []
        for f in futures:
            try:
                f.result()
            except grpc.RpcError as e:
                refused.append(e)
    assert refused, "8 requests at once cannot all fit 1 slot + 2 queued"
    assert len(refused) <= 5
    for e in refused:
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert "max_inflight_requests 1 + max_queued_requests 2" in e.details()
        assert "overloaded, retry later" in e.details()
    with TeacherClient(server.target, retries=10, backoff_s=0.2) as client:
        alone = [client.score([s], 4) for s in seqs]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda s: client.score([s], 4), seqs))
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
        with pytest.raises(ResourceExhaustedError, match="max_tokens_per_request 4000"):
            client.score([np.arange(4001) % 512], 4)  # not retried: the request must change


def _admission_order(fair: bool) -> list[str]:
    """One slot, held; a flood stream queues 6 requests, then a canary stream queues
    one: the order the slot goes round once released each time."""

    async def main() -> list[str]:
        q = AdmissionQueue(1, 100, fair=fair)
        await q.acquire()
        order: list[str] = []

        async def waiter(stream: str, i: int) -> None:
            await q.acquire("client", stream)
            order.append(f"{stream}{i}")
            q.release()

        tasks = [asyncio.create_task(waiter("flood", i)) for i in range(6)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(waiter("canary", 0)))
        await asyncio.sleep(0)
        q.release()
        await asyncio.gather(*tasks)
        return order

    return asyncio.run(main())


def test_a_stream_with_one_request_is_served_next_not_after_the_flood() -> None:
    assert _admission_order(fair=True) == [
        "flood0",
        "canary0",
        "flood1",
        "flood2",
        "flood3",
        "flood4",
        "flood5",
    ]
    # --admission-order arrival: behind the whole flood.
    assert _admission_order(fair=False)[-1] == "canary0"


def test_a_cancelled_fair_waiter_leaves_its_stream_and_the_turns_go_on() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, 10)
        await q.acquire()
        a = asyncio.create_task(q.acquire("c", "s1"))
        b = asyncio.create_task(q.acquire("c", "s1"))
        c = asyncio.create_task(q.acquire("c", "s2"))
        await asyncio.sleep(0)
        assert q.queued == 3
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        assert q.queued == 2
        q.release()
        await asyncio.sleep(0)
        assert b.done() and not c.done()  # s1's next, then s2
        q.release()
        await asyncio.wait_for(c, 1)
        q.release()
        await asyncio.wait_for(q.wait_idle(), 1)

    asyncio.run(main())
