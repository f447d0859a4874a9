"""The report of `benchmarks/quality_cross_tokenizer.py`: the table, the verdicts (a
difference against the seed spread) and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.quality_cross_tokenizer import (
    BenchConfig,
    RunResult,
    format_table,
    plot,
    verdicts,
)

PAIR = "bpe8k -> bpe4k"


def _runs(finals: dict[str, list[float]]) -> list[RunResult]:
    return [
        RunResult(PAIR, arm, seed, [0, 10, 20], [3.0, 2.5, final], 1.0, 2.0, 0.125)
        for arm, values in finals.items()
        for seed, final in enumerate(values)
    ]


def test_verdicts_weigh_the_difference_against_the_larger_seed_range() -> None:
    runs = _runs({"b": [2.0, 2.1, 2.2], "c": [1.9, 1.9, 1.9], "d": [1.5, 1.6, 1.55]})
    lines = verdicts(runs, [PAIR])
    assert lines[0].startswith(f"{PAIR}: (d) beats (b) by 0.5500")
    assert "more than the seed spread (0.2000)" in lines[0]
    assert lines[1].startswith(f"{PAIR}: (d) beats (c) by 0.3500")
    close = verdicts(_runs({"b": [1.5, 1.7, 1.6], "d": [1.55, 1.6, 1.62]}), [PAIR])
    assert "(d) beats (b) by 0.0100" in close[0] and "less than the seed spread" in close[0]


def test_format_table_has_one_row_per_arm_with_the_mean_range_and_the_difference() -> None:
    runs = _runs({"b": [2.0, 2.2], "d": [1.5, 1.7]})
    table = format_table(runs, [PAIR], {PAIR: 1.25}, BenchConfig(steps=20))
    assert "masked rows 12.5%" in table and "the teacher 1.2500 nats/byte" in table
    rows = [line for line in table.splitlines() if line.startswith("| (")]
    assert len(rows) == 2
    assert rows[1].split(" | ")[2:4] == ["1.6000 (1.5000-1.7000)", "-0.5000"]
    assert "20 steps x 8 windows" in table


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "curves.png"
    plot(_runs({"b": [2.0, 2.2], "d": [1.5, 1.7]}), [PAIR], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
