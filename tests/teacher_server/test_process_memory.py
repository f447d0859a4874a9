"""The process tree's resident memory by process and kind (``teacher_server.process_memory``)
and its gauge on ``/metrics``: a child process is found, shared memory is counted as
``shared``, and on the live vLLM teacher the engine core and the worker are named and the
message queue they share is seen by both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from multiprocessing import shared_memory

import numpy as np
import pytest

from student_client import TeacherClient
from teacher_server.process_memory import process_label, resident_bytes, tree_resident_bytes

MIB = 1 << 20


def test_a_child_process_is_found_and_labelled_other() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert process_label(child.pid, os.getpid()) == "other"
        assert process_label(os.getpid(), os.getpid()) == "server"
        totals = tree_resident_bytes()
        assert totals["server", "anonymous"] > 0
        assert totals["other", "anonymous"] > 0  # the child's interpreter
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_reports_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert resident_bytes(child.pid) == {}
    assert set(resident_bytes(os.getpid())) == {"anonymous", "file", "shared"}


def test_touched_shared_memory_is_counted_as_shared() -> None:
    before = tree_resident_bytes()["server", "shared"]
    segment = shared_memory.SharedMemory(create=True, size=16 * MIB)
    try:
        np.frombuffer(segment.buf, dtype=np.uint8)[:] = 1  # every page resident
        after = tree_resident_bytes()["server", "shared"]
        assert after - before >= 16 * MIB
    finally:
        segment.close()
        segment.unlink()


def _resident(http: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    pattern = r'^topk_teacher_process_resident_bytes\{kind="(\w+)",process="(\w+)"\} (\S+)$'
    return {(p, k): float(v) for k, p, v in re.findall(pattern, text, re.M)}


@pytest.mark.vllm
def test_metrics_name_vllms_processes_and_their_shared_queue(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    with TeacherClient(vllm_teacher.target) as client:
        tokens = np.random.default_rng(3).integers(0, 512, (4, 1024)).astype(np.int32)
        assert client.score(list(tokens), 64).ids.shape == (4, 1024, 64)
    resident = _resident(vllm_teacher.http)
    for process in ("server", "engine_core", "worker"):
        assert resident[process, "anonymous"] > 0, process
    # the worker's answers reach the engine core through shared memory both map
    assert resident["engine_core", "shared"] > 0
    assert resident["worker", "shared"] > 0
