"""The injected leak that the memory guard is shown to catch: off by default, N MiB kept
and resident per call when asked, a bad value refused naming the variable."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from teacher_server import leak_injection
from teacher_server.config import MIB
from teacher_server.leak_injection import INJECT_LEAK_ENV, injected_leak_mib, leak_per_request


@pytest.fixture
def leak_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The variable as each test sets it, read afresh; what a test leaked is let go."""
    injected_leak_mib.cache_clear()
    yield monkeypatch
    monkeypatch.delenv(INJECT_LEAK_ENV, raising=False)
    injected_leak_mib.cache_clear()
    leak_injection._kept.clear()


def test_no_leak_unless_asked(leak_env: pytest.MonkeyPatch) -> None:
    leak_env.delenv(INJECT_LEAK_ENV, raising=False)
    assert injected_leak_mib() == 0
    leak_per_request()
    assert leak_injection._kept == []


def test_each_call_keeps_the_stated_size_resident(leak_env: pytest.MonkeyPatch) -> None:
    leak_env.setenv(INJECT_LEAK_ENV, "16")
    for _ in range(3):
        leak_per_request()
    assert [len(b) for b in leak_injection._kept] == [16 * MIB] * 3
    # Written on every page (a written page is resident; a reserved one would read as 0).
    # Not measured as RSS growth: in a long test process the allocator hands back pages
    # that are resident already, so the growth can be less than what was kept.
    page = os.sysconf("SC_PAGE_SIZE")
    for kept in leak_injection._kept:
        assert (np.frombuffer(kept, np.uint8)[::page] == 0xA5).all()


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_value_is_refused_naming_the_variable(
    leak_env: pytest.MonkeyPatch, value: str
) -> None:
    leak_env.setenv(INJECT_LEAK_ENV, value)
    with pytest.raises(ValueError, match=rf"^{INJECT_LEAK_ENV}: must be a whole number"):
        injected_leak_mib()
