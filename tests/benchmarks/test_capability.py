"""Benchmarks that need native bf16 check it first: on a CPU without (here: the answer
forced by ``TOPK_DISTILL_ASSUME_NO_NATIVE_BF16``), ``bench_losses --seed-dims`` says what it
skipped and why, and ends at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks.capability import bf16_skip_reason
from teacher_server.backends.cpu_dtype import NO_NATIVE_BF16_ENV, cpu_has_native_bf16


def test_skip_reason_names_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    reason = bf16_skip_reason()
    assert reason is not None and reason.startswith("skipped: this CPU has no native bf16 (")
    monkeypatch.delenv(NO_NATIVE_BF16_ENV)
    assert (bf16_skip_reason() is None) is cpu_has_native_bf16()


def test_seed_dims_skip_without_native_bf16() -> None:
    env = {**os.environ, NO_NATIVE_BF16_ENV: "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_losses", "--seed-dims"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("skipped: this CPU has no native bf16 (")
    assert "V = 248320, K = 128, N = 2048, 4096, 8192" in lines[1]
    assert "float32 version is not run" in lines[2]
    assert len(lines) == 3  # nothing measured
