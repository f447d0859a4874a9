"""Rows shared between requests for the same prefix, without an engine: which rows come
from a kept answer and which the engine is asked for, who waits for whom, the bound on
kept bytes. ``compute`` here is a pure function of the tokens (row ``t`` a function of
``x[: t + 2]``, as a causal model's row with its actual-token log-prob), so a shared
answer must equal the one computed whole. The live engine:
tests/teacher_server/test_prefix_reuse.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from teacher_server.backends.vllm.shared_rows import SharedRows
from teacher_server.validation import ParsedSequence
from topk_protocol import SequenceArrays

BS, K = 4, 3


def _row(prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, int]:
    """A row that depends on its prefix only (ids, log-probs, the actual token's log-prob
    and rank)."""
    h = int(np.int64(np.sum((prefix[:-1].astype(np.int64) + 1) * 7919)) % 1000)
    ids = (np.arange(K) + h) % 50
    return (
        ids.astype(np.int32),
        -np.arange(1, K + 1, dtype=np.float32) - h / 1000,
        -float(prefix[-1] % 17),
        int(prefix[-1] % 13) + 1,
    )


class Engine:
    """Rows ``[start, end)`` of a sequence, and what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []  # (length, start, end)
        self.running = 0
        self.most_running = 0

    async def compute(self, seq: ParsedSequence) -> SequenceArrays:
        self.asked.append((len(seq.token_ids), seq.start, seq.end))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        return whole(seq)


def whole(seq: ParsedSequence) -> SequenceArrays:
    x = seq.token_ids
    rows = [_row(x[: t + 2]) if t + 1 < len(x) else _row(np.append(x, 0)) for t in
            range(seq.start, seq.end)]  # fmt: skip
    sampled = np.array([r[2] for r in rows], np.float32)
    ranks = np.array([r[3] for r in rows], np.int32)
    if seq.end == len(x):
        sampled[-1], ranks[-1] = np.nan, 0
    return SequenceArrays(
        np.stack([r[0] for r in rows]).reshape(-1, K),
        np.stack([r[1] for r in rows]).reshape(-1, K),
        sampled,
        position_start=seq.start,
        sampled_ranks=ranks,
    )


def _same(got: SequenceArrays, want: SequenceArrays) -> None:
    assert got.position_start == want.position_start
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.sampled_logprobs, want.sampled_logprobs)
    np.testing.assert_array_equal(got.sampled_ranks, want.sampled_ranks)


def _group(prompt: int, completion: int, g: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 50, prompt).astype(np.int32)
    out = []
    for i in range(g):
        tail = rng.integers(0, 50, completion).astype(np.int32)
        tail[0] = 50 + i  # completions differ from their first token
        out.append(np.concatenate([head, tail]))
    return out


def _full(seq: np.ndarray) -> ParsedSequence:
    return ParsedSequence(seq, 0, len(seq))


async def _score_all(
    rows: SharedRows, engine: Engine, seqs: list[ParsedSequence], options: int = K
) -> list[SequenceArrays]:
    return list(await asyncio.gather(*(rows.score(s, options, engine.compute) for s in seqs)))


def test_a_group_sent_at_once_computes_its_prompt_once() -> None:
    """G = 5 full requests (slime's way), prompt 3 blocks + 1: the first computes every
    row, the others wait for it, then ask only from the last shared row on."""
    prompt, completion = 3 * BS + 1, 6
    seqs = [ParsedSequence(s, 0, len(s)) for s in _group(prompt, completion, 5)]
    rows, engine = SharedRows(BS, 1 << 20), Engine()
    got = asyncio.run(_score_all(rows, engine, seqs))
    for g, s in zip(got, seqs, strict=True):
        _same(g, whole(s))
    length = prompt + completion
    assert engine.asked[0] == (length, 0, length)
    # Rows 0 .. prompt - 2 shared; row prompt - 1 (its actual token differs) computed.
    assert sorted(engine.asked[1:]) == [(length, prompt - 1, length)] * 4
    assert rows.waited == 4 and rows.rows_shared == 4 * (prompt - 1)


def test_unrelated_requests_never_wait_and_share_nothing() -> None:
    seqs = [_full(_group(9, 7, 1, seed)[0]) for seed in range(4)]
    rows, engine = SharedRows(BS, 1 << 20), Engine()
    got = asyncio.run(_score_all(rows, engine, seqs))
    for g, s in zip(got, seqs, strict=True):
        _same(g, whole(s))
    assert rows.waited == 0 and rows.rows_shared == 0
    assert engine.most_running == 4  # all four ran together
    assert sorted(engine.asked) == [(16, 0, 16)] * 4


def test_a_sub_range_and_a_repeat_are_answered_from_the_kept_rows() -> None:
    (seq,) = _group(3 * BS, 5, 1)
    rows, engine = SharedRows(BS, 1 << 20), Engine()
    first = ParsedSequence(seq, 0, len(seq))
    asyncio.run(_score_all(rows, engine, [first]))
    # Rows [2, L - 1): all kept (the same tokens): no engine call.
    part = ParsedSequence(seq, 2, len(seq) - 1)
    (got,) = asyncio.run(_score_all(rows, engine, [part]))
    _same(got, whole(part))
    assert len(engine.asked) == 1
    # Every row again: the last one (no next token) is asked of the engine alone.
    (again,) = asyncio.run(_score_all(rows, engine, [first]))
    _same(again, whole(first))
    assert engine.asked[-1] == (len(seq), len(seq) - 1, len(seq))


def test_other_options_a_short_prefix_or_a_later_kept_start_share_nothing() -> None:
    a, b = _group(3 * BS, 4, 2)
    rows, engine = SharedRows(BS, 1 << 20), Engine()
    asyncio.run(_score_all(rows, engine, [ParsedSequence(a, 0, len(a))]))
    asyncio.run(_score_all(rows, engine, [ParsedSequence(b, 0, len(b))], options=K + 1))
    assert engine.asked[-1] == (len(b), 0, len(b))  # another K: computed whole
    short = np.concatenate([a[: BS + 1], b[BS + 1 :] + 1]).astype(np.int32)
    asyncio.run(_score_all(rows, engine, [ParsedSequence(short, 0, len(short))], options=K + 2))
    asyncio.run(_score_all(rows, engine, [ParsedSequence(short, 0, len(short))], options=K))
    assert engine.asked[-1] == (len(short), 0, len(short))  # 5 tokens shared: under a block
    kept_late = SharedRows(BS, 1 << 20)
    asyncio.run(_score_all(kept_late, engine, [ParsedSequence(a, 8, len(a))]))
    asyncio.run(_score_all(kept_late, engine, [ParsedSequence(b, 0, len(b))]))
    assert engine.asked[-1] == (len(b), 0, len(b))  # kept rows start after 0
    assert rows.rows_shared == 0 and kept_late.rows_shared == 0


def test_kept_bytes_stay_under_the_bound_oldest_out_first() -> None:
    seqs = [_full(_group(2 * BS, 4, 1, seed)[0]) for seed in range(6)]
    one = 12 * 4 + 12 * K * 8 + 12 * 4 * 2  # tokens, ids + log-probs, actual log-probs + ranks
    rows, engine = SharedRows(BS, 2 * one + 1), Engine()
    for s in seqs:
        asyncio.run(_score_all(rows, engine, [s]))
        assert rows.kept_bytes <= 2 * one + 1
    asyncio.run(_score_all(rows, engine, [seqs[0]]))  # evicted: computed whole again
    assert engine.asked[-1] == (12, 0, 12)
    asyncio.run(_score_all(rows, engine, [seqs[-1]]))  # kept: only the last row
    assert engine.asked[-1] == (12, 11, 12)


def test_slices_and_concatenation_keep_positions() -> None:
    (seq,) = _group(2 * BS, 4, 1)
    full = whole(ParsedSequence(seq, 0, len(seq)))
    _same(SequenceArrays.concat([full.positions(0, 5), full.positions(5, 12)]), full)
    assert full.positions(3, 7).position_start == 3


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        SharedRows(0)
    with pytest.raises(ValueError, match="max_bytes"):
        SharedRows(BS, 0)


def test_a_repeat_adds_no_copy_and_clear_forgets_everything() -> None:
    (seq,) = _group(3 * BS, 5, 1)
    rows, engine = SharedRows(BS, 1 << 20), Engine()
    asyncio.run(_score_all(rows, engine, [_full(seq)]))
    kept = rows.kept_bytes
    for _ in range(3):  # the same sequence again: the last row computed, nothing kept
        (got,) = asyncio.run(_score_all(rows, engine, [_full(seq)]))
        _same(got, whole(_full(seq)))
    assert rows.kept_bytes == kept > 0
    rows.clear()
    assert rows.kept_bytes == 0
    asyncio.run(_score_all(rows, engine, [_full(seq)]))
    assert engine.asked[-1] == (len(seq), 0, len(seq))  # computed whole again
