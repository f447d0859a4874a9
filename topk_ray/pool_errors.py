"""The errors of :mod:`topk_ray` (each message names the setting, pool or replica)."""

from __future__ import annotations

__all__ = ["PoolError"]


class PoolError(RuntimeError):
    """The pool cannot do what it was asked; the message names the setting or replica."""
