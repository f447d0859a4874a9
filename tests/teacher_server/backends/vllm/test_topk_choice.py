"""``--engine-topk auto`` picks the faster top-k from the workers' timings: the choice
function on given timings (no clock involved), and the timed batch's shape."""

from __future__ import annotations

import math

import pytest
import torch

from teacher_server.backends.vllm.topk_choice import TopkChoice, choose_by_speed
from teacher_server.backends.vllm.worker import (
    KERNEL,
    TIMING_ROWS,
    VLLM_TOPK,
    time_gather,
    timing_rows,
)

V, K = 151_936, 64


def test_the_faster_one_is_picked_and_the_reason_gives_both_timings() -> None:
    # The figures at V = 151,936 on an AVX2 CPU: kernel 455 us, vLLM's 226.
    got = choose_by_speed([[226e-6, 455e-6]], V, K)
    assert got == TopkChoice(
        VLLM_TOPK,
        "vLLM's torch.topk is faster: the kernel takes 455.00 us/row against vLLM's "
        "226.00 at V = 151,936, K = 64",
    )
    small = choose_by_speed([[2.6e-6, 0.43e-6]], 512, K)
    assert small.name == KERNEL
    assert small.reason == (
        "the kernel is faster: 0.43 us/row against vLLM's 2.60 at V = 512, K = 64"
    )


def test_a_tie_keeps_the_kernel() -> None:
    assert choose_by_speed([[1e-5, 1e-5]], V, K).name == KERNEL


def test_workers_are_summed_not_voted() -> None:
    # Two workers slightly favour the kernel, one strongly favours vLLM's: vLLM's in sum.
    per_worker = [[10e-6, 9e-6], [10e-6, 9e-6], [10e-6, 30e-6]]
    assert choose_by_speed(per_worker, V, K).name == VLLM_TOPK
    assert choose_by_speed(per_worker[:2], V, K).name == KERNEL


@pytest.mark.parametrize(
    "per_worker",
    [[], [[]], [[1e-5]], [[1e-5, math.nan]], [[0.0, 1e-5]], [[1e-5, 1e-5], [math.inf, 1e-5]]],
)
def test_no_usable_timing_keeps_the_kernel(per_worker: list[list[float]]) -> None:
    got = choose_by_speed(per_worker, V, K)
    assert got.name == KERNEL
    assert "gave no figures" in got.reason


def test_timing_rows_keep_a_big_vocabulary_out_of_cache_and_stay_bounded() -> None:
    lo, hi = TIMING_ROWS
    assert timing_rows(512) == hi
    assert lo <= timing_rows(V) < hi
    assert timing_rows(V) * V * 4 >= 64 << 20  # >= 64 MiB of float32 rows
    assert timing_rows(10**9) == lo


def test_time_gather_calls_both_alike_and_reports_per_row() -> None:
    calls: list[tuple[str, tuple[int, ...], int, tuple[int, ...]]] = []

    def fn(name: str):  # type: ignore[no-untyped-def]
        def gather(logprobs: torch.Tensor, k: int, token_ids: torch.Tensor) -> None:
            calls.append((name, tuple(logprobs.shape), k, tuple(token_ids.shape)))

        return gather

    per_row = time_gather(fn("vllm"), fn("kernel"), 1000, 7, reps=3)
    rows = timing_rows(1000)
    assert [c[0] for c in calls] == ["vllm", "kernel"] * 4  # a warm-up round, then 3
    assert {c[1:] for c in calls} == {((rows, 1000), 7, (rows,))}
    assert len(per_row) == 2 and all(t >= 0 for t in per_row)
