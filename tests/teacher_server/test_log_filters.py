"""The server's log filters: grpc's traceback for a client that went away becomes one
INFO line; vLLM's Triton "no CPU backend" warning is dropped; other records pass.

The first test reproduces the real event: a client killed while the server is blocked
writing to its stream (answers of about 1 MB each, the client reading none after the
first) makes grpc fail that write with ``ExecuteBatchError``; without the filter, grpc logs
it as an ERROR with a traceback."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, start_server
from grpc._cython import cygrpc

from teacher_server import log_filters


@pytest.fixture
def records() -> list[logging.LogRecord]:
    log_filters.install()
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(logging.INFO)
    names = ("grpc._cython.cygrpc", "vllm.triton_utils.importing")
    for name in names:
        logging.getLogger(name).addHandler(handler)
    yield seen
    for name in names:
        logging.getLogger(name).removeHandler(handler)


_DYING_CLIENT = textwrap.dedent(
    """
    import os, signal, sys, time
    import grpc
    sys.path.insert(0, {root!r})
    from topk_protocol import build_request, pb_grpc
    stub = pb_grpc.TeacherStub(grpc.insecure_channel({target!r}))
    tokens = [[1, 2, 3, 4, 5, 6, 7, 8] * 120]  # 960 positions x K 256: ~1 MB answers
    answers = stub.ScoreStream(build_request(tokens, 256, request_id=str(i)) for i in range(500))
    next(answers)
    time.sleep(2)  # read nothing more: the server blocks writing the next answers
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_clients_killed_mid_stream_leave_one_info_line_each(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_server(
        ["--backend", "transformers", "--model", str(tiny_model_dir), "--max-top-k", "256",
         "--dtype", "float32"],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        code = _DYING_CLIENT.format(root=str(ROOT), target=server.target)
        for _ in range(2):
            client = subprocess.run([sys.executable, "-c", code], timeout=300)
            assert client.returncode == -9
        assert server.http_status("/readyz") == 200  # still serving
    finally:
        assert server.stop() == 0
    lines = server.log().splitlines()
    gone = [line for line in lines if "client went away before its call" in line]
    assert len(gone) == 2, server.log()[-3000:]
    assert all(" INFO " in line and "Teacher/ScoreStream" in line for line in gone)
    assert not [line for line in lines if "Traceback" in line or " ERROR " in line]


def test_a_client_gone_mid_stream_is_one_info_line(records: list[logging.LogRecord]) -> None:
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    try:
        raise cygrpc.ExecuteBatchError("Failed execute_batch: (<grpc_call_error: 2>,)")
    except cygrpc.ExecuteBatchError:
        grpc_log.exception(
            "ExecuteBatchError raised in core by servicer method [%s]",
            "/topk_distill.v1.Teacher/ScoreStream",
        )
    grpc_log.error("Unexpected [ValueError] raised by servicer method [/x]")
    gone, other = records
    assert (gone.levelno, gone.exc_info, gone.exc_text) == (logging.INFO, None, None)
    assert gone.getMessage() == log_filters.CLIENT_GONE % "/topk_distill.v1.Teacher/ScoreStream"
    assert other.levelno == logging.ERROR  # anything else stays as it was


def test_tritons_no_cpu_backend_warning_is_dropped(records: list[logging.LogRecord]) -> None:
    triton_log = logging.getLogger("vllm.triton_utils.importing")
    triton_log.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    triton_log.warning("something else")
    assert [r.getMessage() for r in records] == ["something else"]


def test_install_is_idempotent() -> None:
    log_filters.install()
    log_filters.install()
    assert len(logging.getLogger("grpc._cython.cygrpc").filters) == 1
