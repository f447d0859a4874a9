"""`benchmarks/seed_cells.py`: a figure over seeds, written once for every quality table."""

from __future__ import annotations

import doctest

import benchmarks.seed_cells as seed_cells
from benchmarks.seed_cells import mean_and_range


def test_mean_and_range_writes_the_mean_and_the_seeds_range() -> None:
    assert mean_and_range([1.5, 1.7, 1.6]) == "1.600 (1.500-1.700)"
    assert mean_and_range([1.25], digits=4) == "1.2500"
    assert mean_and_range([3.0, 1.0], digits=1) == "2.0 (1.0-3.0)"


def test_the_modules_examples_run() -> None:
    result = doctest.testmod(seed_cells)
    assert result.attempted == 2 and result.failed == 0
