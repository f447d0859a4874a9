"""The prefix-reuse rules without an engine: the cap, the block keys, and the order in
which requests sharing a prefix go (siblings wait for the prefix, unrelated requests never
wait). The live engine: tests/teacher_server/test_prefix_reuse.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from teacher_server.backends.vllm.prefix import PrefixOrder, block_keys, cache_cap, capped_hit

BS = 4


@pytest.mark.parametrize(
    ("start", "cap"), [(0, 0), (1, 0), (3, 0), (4, 4), (5, 4), (7, 4), (8, 8), (9, 8)]
)
def test_the_cap_is_whole_blocks_never_past_the_first_position(start: int, cap: int) -> None:
    assert cache_cap(start, BS) == cap
    assert cache_cap(start, BS) <= start


def test_a_hit_is_cut_to_the_cap_and_left_alone_without_one() -> None:
    assert capped_hit(12, 9, BS) == 8
    assert capped_hit(4, 9, BS) == 4
    assert capped_hit(12, None, BS) == 12
    with pytest.raises(ValueError, match="block_size"):
        cache_cap(3, 0)


def test_block_keys_name_prefixes() -> None:
    a = np.arange(12, dtype=np.int32)
    b = a.copy()
    b[5] = 99  # differs in the second block
    ka, kb = block_keys(a, BS, 3), block_keys(b, BS, 3)
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]
    assert block_keys(a[:8], BS, 2) == ka[:2]


def _run(order: PrefixOrder, seqs: list[np.ndarray], start: int, log: list[str]) -> list[str]:
    async def one(i: int, seq: np.ndarray) -> str:
        async def prefill(n: int) -> None:
            log.append(f"prefill {i} {n}")
            await asyncio.sleep(0.01)
            log.append(f"prefilled {i}")

        async def submit() -> str:
            log.append(f"start {i}")
            await asyncio.sleep(0.01)
            log.append(f"end {i}")
            return f"answer {i}"

        return await order.run(seq, start, submit, prefill)

    async def main() -> list[str]:
        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs))))

    return asyncio.run(main())


def test_siblings_wait_for_the_prompt_once_then_run_together() -> None:
    order, log = PrefixOrder(BS), []
    prompt = np.arange(8, dtype=np.int32)
    seqs = [np.concatenate([prompt, np.full(2, 100 + i, np.int32)]) for i in range(3)]
    assert _run(order, seqs, 8, log) == ["answer 0", "answer 1", "answer 2"]
    assert log[:2] == ["prefill 0 8", "prefilled 0"]  # the prompt alone, once
    assert sorted(log[2:5]) == ["start 0", "start 1", "start 2"]  # then all together
    assert order.waited == 2
    # Again: the prompt is known to be cached, nobody prefills or waits.
    log.clear()
    _run(order, seqs, 8, log)
    assert not [x for x in log if x.startswith("prefill")] and order.waited == 2


def test_unrelated_requests_and_full_requests_never_wait() -> None:
    order, log = PrefixOrder(BS), []
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, 10).astype(np.int32) for _ in range(3)]
    _run(order, seqs, 8, log)
    assert order.waited == 0  # each computes its own prompt, at once
    assert sorted(x for x in log if x.startswith("prefill ")) == [
        "prefill 0 8",
        "prefill 1 8",
        "prefill 2 8",
    ]
    order2, log2 = PrefixOrder(BS), []
    same = [np.arange(10, dtype=np.int32)] * 3
    _run(order2, same, 0, log2)  # every position asked: nothing to read, nobody waits
    assert order2.waited == 0 and sorted(log2[:3]) == ["start 0", "start 1", "start 2"]


def test_a_short_shared_prefix_is_not_worth_waiting_for() -> None:
    order, log = PrefixOrder(BS), []
    head = np.arange(4, dtype=np.int32)  # one block shared, 20 tokens each
    seqs = [np.concatenate([head, np.full(16, i, np.int32)]) for i in range(2)]
    _run(order, seqs, 4, log)
    assert order.waited == 0
