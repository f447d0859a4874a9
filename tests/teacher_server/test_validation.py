"""Every invalid input gets the right gRPC status and a message naming the field and the
limit, from the pure validator and from the live vLLM server, which keeps serving."""

from __future__ import annotations

import time
import urllib.request

import grpc
import numpy as np
import pytest

from teacher_server.validation import Limits, parse_request
from topk_protocol import RequestOptions, encode_token_ids, pb, pb_grpc
from topk_protocol.errors import TeacherError
from topk_protocol.status import status_of

LIMITS = Limits(
    vocab_size=512, max_top_k=256, max_tokens_per_request=65536, max_sequence_length=4095
)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _seq(
    ids: list[int] | np.ndarray, start: int | None = None, end: int | None = None
) -> pb.SequenceRequest:
    s = pb.SequenceRequest(token_ids=encode_token_ids(np.asarray(ids, dtype=np.int64)))
    if start is not None:
        s.position_start = start
    if end is not None:
        s.position_end = end
    return s


def _req(seqs: list[pb.SequenceRequest], k: int = 8, dtype: int = 2) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id="bad", sequences=seqs, top_k=k, dtype=dtype)  # type: ignore[arg-type]


# (name, request, status, words the message must contain)
CASES = [
    ("no sequences", _req([]), INVALID, ["sequences", "at least 1"]),
    (
        "empty sequence",
        _req([_seq([1, 2]), _seq([])]),
        INVALID,
        ["sequences[1].token_ids", "empty"],
    ),
    (
        "token too large",
        _req([_seq([1, 512])]),
        INVALID,
        ["sequences[0].token_ids[1]", "512", "[0, 512)"],
    ),
    (
        "negative token",
        _req([_seq([-1])]),
        INVALID,
        ["sequences[0].token_ids[0]", "-1", "[0, 512)"],
    ),
    (
        "ragged bytes",
        _req([pb.SequenceRequest(token_ids=b"\x01\x00\x00")]),
        INVALID,
        ["token_ids", "multiple of 4"],
    ),
    ("k zero", _req([_seq([1])], k=0), INVALID, ["top_k", "[1, 256]"]),
    ("k too large", _req([_seq([1])], k=257), INVALID, ["top_k", "257", "[1, 256]"]),
    ("unknown dtype", _req([_seq([1])], dtype=7), INVALID, ["dtype", "7", "float16"]),
    (
        "range past end",
        _req([_seq([1, 2, 3], 0, 4)]),
        INVALID,
        ["position_start/position_end", "[0, 4)", "3"],
    ),
    ("range reversed", _req([_seq([1, 2, 3], 2, 1)]), INVALID, ["sequences[0].position", "[2, 1)"]),
    ("start past end", _req([_seq([1, 2, 3], 5)]), INVALID, ["sequences[0].position", "[5, 3)"]),
    (
        "sequence too long",
        _req([_seq(np.zeros(4096, np.int64))]),
        INVALID,
        ["length 4096", "max_sequence_length 4095"],
    ),
    (
        "too many tokens",
        _req([_seq(np.zeros(40000, np.int64)), _seq(np.zeros(30000, np.int64))]),
        EXHAUSTED,
        ["70000", "max_tokens_per_request 65536"],
    ),
]


@pytest.mark.parametrize(("name", "request_", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_parse_request_rejects(
    name: str, request_: pb.ScoreRequest, code: grpc.StatusCode, words: list[str]
) -> None:
    with pytest.raises(TeacherError) as err:
        parse_request(request_, LIMITS)
    assert status_of(err.value)[0] == code
    for w in words:
        assert w in err.value.message, (w, err.value.message)


def test_parse_request_accepts_defaults() -> None:
    parsed = parse_request(_req([_seq([1, 2, 3]), _seq([4], 0, 0)], dtype=0), LIMITS)
    assert parsed.options == RequestOptions(top_k=parsed.options.top_k)  # the defaults
    assert parsed.options.wire_dtype == pb.LOGPROB_DTYPE_FLOAT16 and parsed.options.include_sampled
    assert [(s.start, s.end) for s in parsed.sequences] == [(0, 3), (0, 0)]
    assert parsed.num_positions == 3


@pytest.mark.vllm
@pytest.mark.parametrize(("name", "request_", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_live_server_rejects_and_keeps_serving(
    vllm_teacher, name: str, request_: pb.ScoreRequest, code: grpc.StatusCode, words: list[str]
) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(vllm_teacher.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request_, timeout=60)
        assert err.value.code() == code
        for w in words:
            assert w in err.value.details(), (w, err.value.details())
        # On a stream the same request is answered with an Error and the stream goes on.
        good = _req([_seq([1, 2, 3])])
        good.request_id = "good"
        answers = {m.request_id: m for m in stub.ScoreStream(iter([request_, good]), timeout=60)}
        assert answers["bad"].error.code == code.value[0]
        assert words[0] in answers["bad"].error.message
        assert not answers["good"].HasField("error") and answers["good"].final
        assert len(answers["good"].sequences) == 1
        # And the server keeps serving unary calls.
        assert stub.Score(good, timeout=60).sequences[0].num_positions == 3


@pytest.mark.vllm
def test_unary_response_over_message_limit(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    """Score refuses a response larger than the message limit and points to ScoreStream."""
    big = _req([_seq(np.zeros(4000, np.int64))] * 16, k=256, dtype=1)  # 16 x 4000 x 256 x 8 B
    with grpc.insecure_channel(vllm_teacher.target) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.TeacherStub(ch).Score(big, timeout=60)
    assert err.value.code() == EXHAUSTED
    assert "max_message_bytes" in err.value.details() and "ScoreStream" in err.value.details()


def _in_flight(http: str) -> float:
    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as r:
        text = r.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("topk_teacher_requests_in_flight "))
    return float(line.split()[1])


def test_in_flight_limit(teacher_factory, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """With 1 request in flight and no queue, a second concurrent one gets UNAVAILABLE
    (overloaded: the client retries it), naming both limits."""
    server = teacher_factory(
        [
            "--backend",
            "transformers",
            "--model",
            str(tiny_model_dir),
            "--max-inflight-requests",
            "1",
            "--max-queued-requests",
            "0",
        ]
    )
    slow = _req([_seq(np.arange(4000) % 512)] * 6, k=8)
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        first = stub.Score.future(slow, timeout=120)
        # Probe only once the server has the slow request in flight.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not first.done():
            if _in_flight(server.http) == 1:
                break
            time.sleep(0.02)
        assert not first.done(), "the slow request finished before it could be observed"
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(_req([_seq([1, 2])]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "max_inflight_requests 1 + max_queued_requests 0" in err.value.details()
        assert first.result().final
        assert stub.Score(_req([_seq([1, 2])]), timeout=30).final
