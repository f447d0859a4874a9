"""Each loss entry point's docstring has a runnable example, and it runs as written."""

from __future__ import annotations

import doctest

import pytest

import student_client.losses as losses

#: The entry points: the public names of a loss (`..._loss`, `...Loss`) or its reference.
ENTRY_POINTS = [
    getattr(losses, name)
    for name in losses.__all__
    if name.endswith(("_loss", "Loss", "_reference"))
]


def test_the_entry_points_are_found() -> None:
    assert {e.__name__ for e in ENTRY_POINTS} >= {
        "topk_kl_loss",
        "lm_head_topk_kl_loss",
        "causal_lm_topk_kl_loss",
        "TopKKLLoss",
        "topk_kl_reference",
    }


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.__name__)
def test_entry_point_example_runs(entry: object) -> None:
    tests = doctest.DocTestFinder(recurse=False).find(entry)
    examples = [t for t in tests if t.examples]
    assert examples, f"{entry.__qualname__}: no >>> example in its docstring"  # type: ignore[attr-defined]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted >= 3
