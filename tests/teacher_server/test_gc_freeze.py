"""The server's start-up objects leave the garbage collector's reach while it serves
(``gc.freeze``) and come back when the last server of the process stops: frozen, they
would outlive the interpreter's final collection, and an extension holding objects among
them (Triton's nanobind module) reports them leaked at exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.validation import ParsedSequence
from tests.teacher_server.loopback import LoopbackTeacher
from topk_protocol import RequestOptions, SequenceArrays

ROOT = Path(__file__).resolve().parents[2]


class ZeroBackend(Backend):
    """Answers ids 0 and log-probs 0 everywhere."""

    def __init__(self) -> None:
        self.info = BackendInfo("zero", 512, "f" * 64, 64, 0, "zero")

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        n, k = sequence.end - sequence.start, options.top_k
        zeros = np.zeros((n, k), np.float32)
        return SequenceArrays(
            zeros.astype(np.int32), zeros, np.zeros(n, np.float32), sequence.start
        )


def test_the_last_server_to_stop_unfreezes_the_start_up_objects() -> None:
    gc.unfreeze()
    first = LoopbackTeacher(ZeroBackend())
    assert gc.get_freeze_count() > 0
    second = LoopbackTeacher(ZeroBackend())
    first.stop()
    assert gc.get_freeze_count() > 0  # the second one still serves
    second.stop()
    assert gc.get_freeze_count() == 0


def test_no_leak_report_at_exit_after_a_server_ran_with_triton_imported() -> None:
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import triton  # a nanobind extension: it reports objects alive at exit
        from tests.teacher_server.loopback import LoopbackTeacher
        from tests.teacher_server.test_gc_freeze import ZeroBackend

        LoopbackTeacher(ZeroBackend()).stop()
        print("served")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "served"
    assert "nanobind" not in done.stderr, done.stderr[-2000:]
