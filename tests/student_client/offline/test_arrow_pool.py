"""``teacher-record`` runs on Arrow's jemalloc pool on Linux (imported before pyarrow),
unless the user chose a pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_POOL = (
    "import student_client.offline.record_cli, pyarrow as pa; "
    "print(pa.default_memory_pool().backend_name)"
)


def _pool(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    full = {**base, "PYTHONPATH": str(ROOT), **env}
    res = subprocess.run([sys.executable, "-c", _POOL], capture_output=True, text=True,
                         env=full, cwd=ROOT, timeout=300, check=True)  # fmt: skip
    return res.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="the jemalloc default is Linux's")
def test_the_recorder_picks_jemalloc() -> None:
    assert _pool() == "jemalloc"
    assert _pool(ARROW_DEFAULT_MEMORY_POOL="") == "jemalloc"  # empty: not a choice


def test_the_users_pool_wins() -> None:
    assert _pool(ARROW_DEFAULT_MEMORY_POOL="system") == "system"
