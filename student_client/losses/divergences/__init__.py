"""Divergences between the coarse-grained teacher and student distributions.

`base.py` is the interface, `registry.py` the table of names; each divergence is one module.
"""

from student_client.losses.divergences.base import TAIL, CoarseRows, Divergence
from student_client.losses.divergences.registry import DIVERGENCES, get_divergence

__all__ = ["DIVERGENCES", "TAIL", "CoarseRows", "Divergence", "get_divergence"]
