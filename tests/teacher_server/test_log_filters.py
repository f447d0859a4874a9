"""The server's log filters: grpc's traceback for a client that went away becomes one
INFO line; vLLM's Triton "no CPU backend" warning is dropped; other records pass."""

from __future__ import annotations

import logging

import pytest
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
