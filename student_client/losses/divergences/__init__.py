"""Divergences between the coarse-grained teacher and student distributions.

`interface.py` is the interface, `lookup.py` the table of names; each divergence is one module.
"""

from student_client.losses.divergences.interface import TAIL, CoarseRows, Divergence
from student_client.losses.divergences.lookup import DIVERGENCES, get_divergence

__all__ = ["DIVERGENCES", "TAIL", "CoarseRows", "Divergence", "get_divergence"]
