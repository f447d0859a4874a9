"""How the quality benchmarks write a figure measured over several seeds."""

from __future__ import annotations

__all__ = ["mean_and_range"]


def mean_and_range(values: list[float], digits: int = 3) -> str:
    """The mean of ``values`` and, when there are several, their range in parentheses:
    ``"1.600 (1.500-1.700)"``.

    >>> mean_and_range([1.5, 1.7], digits=2)
    '1.60 (1.50-1.70)'
    >>> mean_and_range([2.0])
    '2.000'
    """
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
