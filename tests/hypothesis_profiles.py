"""Hypothesis settings profiles for the suite; `conftest.py` loads one at start-up.

- ``derandomized`` (the default, what ``make test`` runs): every property test draws
  the same examples on every run and machine, so the suite gives the same verdict twice.
  A failure prints its reproduction blob (``@reproduce_failure``); add the case as an
  explicit ``@example`` once understood.
- ``fuzz`` (opt-in: ``HYPOTHESIS_PROFILE=fuzz``): random examples, ``FUZZ_FACTOR`` times
  as many per test; for hunting new failures, never for a verdict.

Tests size their example budget with :func:`examples` (never a bare ``max_examples``), so
the fuzz profile widens every test; no test sets ``derandomize`` or a ``@seed`` itself.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
DERANDOMIZED = "derandomized"
FUZZ = "fuzz"
#: How many times each test's example budget the fuzz profile draws.
FUZZ_FACTOR = 10

settings.register_profile(DERANDOMIZED, derandomize=True, deadline=None, print_blob=True)
settings.register_profile(FUZZ, derandomize=False, deadline=None, print_blob=True)


def active_profile() -> str:
    """The profile ``HYPOTHESIS_PROFILE`` names (``derandomized`` when unset)."""
    name = os.environ.get(PROFILE_ENV, DERANDOMIZED)
    if name not in (DERANDOMIZED, FUZZ):
        raise ValueError(f"{PROFILE_ENV}={name!r}: expected {DERANDOMIZED!r} or {FUZZ!r}")
    return name


def load_profile() -> str:
    """Load the active profile; returns its name."""
    name = active_profile()
    settings.load_profile(name)
    return name


def examples(budget: int) -> int:
    """A test's ``max_examples``: ``budget`` in ``make test``, ``FUZZ_FACTOR`` times that
    under the fuzz profile."""
    return budget * FUZZ_FACTOR if active_profile() == FUZZ else budget
