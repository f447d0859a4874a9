"""The CPU KV-cache default: a quarter of the available memory, 1-8 GiB; explicit values
and vLLM's environment variable win."""

from __future__ import annotations

import pytest

from teacher_server.backends.cpu_kv_cache import (
    CPU_KV_CACHE_ENV,
    cpu_kv_cache_bytes,
    default_cpu_kv_cache_bytes,
)

GIB = 1024**3


@pytest.mark.parametrize(
    ("available", "expected"),
    [(0, 1), (2 * GIB, 1), (12 * GIB + 5, 3), (31 * GIB, 7), (512 * GIB, 8)],
)
def test_default(available: int, expected: int) -> None:
    assert default_cpu_kv_cache_bytes(available) == expected * GIB


def test_explicit_and_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    assert cpu_kv_cache_bytes(123) == 123
    default = cpu_kv_cache_bytes(None)
    assert default is not None and GIB <= default <= 8 * GIB
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "2")
    assert cpu_kv_cache_bytes(None) is None  # vLLM reads the variable itself
    assert cpu_kv_cache_bytes(456) == 456
