"""A leak of a stated size, on purpose, for showing that the memory guard of the tests
catches one (``tests/teacher_server/test_malloc_trim.py``); off unless the environment
asks for it, which a deployment never does.

With ``TOPK_DISTILL_INJECT_LEAK_MIB=N`` in the server's environment, every request the
server admits (``Score``, each request of a ``ScoreStream``, the HTTP routes) makes it keep
``N`` MiB more, written so that every page is resident, and never free it: the leak
grows with the work, as a real one (answers kept by mistake) would. malloc_trim cannot
give it back.
"""

from __future__ import annotations

import os
from functools import cache

from teacher_server.config import MIB

__all__ = ["INJECT_LEAK_ENV", "injected_leak_mib", "leak_per_request"]

#: The environment variable: MiB kept per admitted request (unset or 0: no leak).
INJECT_LEAK_ENV = "TOPK_DISTILL_INJECT_LEAK_MIB"

_kept: list[bytearray] = []


@cache
def injected_leak_mib() -> int:
    """``TOPK_DISTILL_INJECT_LEAK_MIB`` as a whole number of MiB >= 0 (0 when unset); a
    bad value is an error naming the variable."""
    raw = os.environ.get(INJECT_LEAK_ENV, "").strip()
    if not raw:
        return 0
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"{INJECT_LEAK_ENV}: must be a whole number of MiB >= 0, got {raw!r}")
    return mib


def leak_per_request() -> None:
    """Keep :func:`injected_leak_mib` MiB for good (nothing when it is 0)."""
    mib = injected_leak_mib()
    if mib:
        _kept.append(bytearray(b"\xa5") * (mib * MIB))  # filled: every page resident
