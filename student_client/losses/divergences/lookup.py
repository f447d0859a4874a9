"""The divergences by name: the one table `LossOptions(divergence=...)` reads.

Adding a divergence: one module in this package (a frozen dataclass implementing
`base.Divergence`) and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from student_client.losses.divergences.interface import Divergence

__all__ = ["DIVERGENCES", "get_divergence"]

#: name -> "module:class".
DIVERGENCES: dict[str, str] = {
    "forward": "student_client.losses.divergences.forward_kl:ForwardKL",
    "reverse": "student_client.losses.divergences.reverse_kl:ReverseKL",
    "jsd": "student_client.losses.divergences.jsd:GeneralizedJSD",
}


def get_divergence(spec: str | Divergence, **params: Any) -> Divergence:
    """The divergence registered as `spec` built with `params` (e.g. `beta=0.3`), or `spec`
    itself when it is already a divergence object (then `params` must be empty).

    Raises:
        ValueError: naming `divergence`, for an unknown name or parameters it does not take.
    """
    if not isinstance(spec, str):
        if not callable(getattr(spec, "terms", None)):
            raise ValueError(
                f"divergence: must be one of {', '.join(DIVERGENCES)} or a Divergence, "
                f"got {type(spec).__name__}"
            )
        if params:
            raise ValueError(f"divergence: parameters {sorted(params)} given with an object")
        return spec
    if spec not in DIVERGENCES:
        raise ValueError(f"divergence: must be one of {', '.join(DIVERGENCES)}, got {spec!r}")
    module, cls = DIVERGENCES[spec].split(":")
    try:
        divergence: Divergence = getattr(importlib.import_module(module), cls)(**params)
    except TypeError as e:
        raise ValueError(f"divergence: {spec!r} does not take {sorted(params)}: {e}") from e
    return divergence
