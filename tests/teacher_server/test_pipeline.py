"""The request pipeline: one function runs every request, whatever its front end.

A real ``TeacherServer`` on loopback (gRPC and HTTP, in this process) whose backend raises,
for the sequence whose first token is ``i``, error kind ``i``: gRPC ``Score``,
``ScoreStream``, TRL's HTTP route and the SGLang and vLLM routes report every kind with
the status the one error table gives it (:func:`topk_protocol.codes.code_of`, in gRPC's
codes :func:`topk_protocol.status.status_of`), each in its own error shape, and a kind
added to that table alone reaches them all. Also: bounded gathering, and large requests
validated in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest

from teacher_server import pipeline
from teacher_server.admission import AdmissionQueue
from teacher_server.backends.base import Backend, BackendInfo
from teacher_server.http_api.answers import http_status
from teacher_server.http_api.trl import SEQUENCE_LOGPROBS_METHOD
from teacher_server.lifecycle import Lifecycle, Phase
from teacher_server.metrics import TeacherMetrics
from teacher_server.pipeline import (
    MAX_SEQUENCES_IN_FLIGHT,
    Answered,
    Refused,
    RequestPipeline,
    gather_bounded,
)
from teacher_server.validation import Limits, ParsedSequence, parse_request
from tests.teacher_server.loopback import LoopbackTeacher
from topk_protocol import RequestOptions, SequenceArrays, build_request, pb
from topk_protocol import codes as status_table
from topk_protocol.codes import Status
from topk_protocol.errors import (
    DataLossError,
    DeadlineExceededError,
    InvalidRequestError,
    NotRecordedError,
    RecordingDamagedError,
    RecordingError,
    ResourceExhaustedError,
    TeacherError,
    TeacherMismatchError,
    TeacherUnavailableError,
    UnauthenticatedError,
    VocabMismatchError,
)
from topk_protocol.status import REASON_KEY, status_of


class QuotaExceededError(TeacherError):
    """An error kind that is not in the status table (until a test adds it)."""

    reason: ClassVar[str] = "quota_exceeded"


#: One error of every kind (and two that are not typed errors), by first token.
ERRORS: list[Callable[[], BaseException]] = [
    lambda: InvalidRequestError("x: bad"),
    lambda: ResourceExhaustedError("x: too big"),
    lambda: UnauthenticatedError("x: who"),
    lambda: TeacherUnavailableError("x: busy"),
    lambda: DeadlineExceededError("x: late"),
    lambda: NotRecordedError("x: not recorded"),
    lambda: DataLossError("x: damaged"),
    lambda: TeacherMismatchError("x: other teacher"),
    lambda: VocabMismatchError("x: other vocabulary"),
    lambda: RecordingError(Path("r"), 3, "x: unreadable"),
    lambda: RecordingDamagedError(Path("r"), 1, "x: bad checksum"),
    lambda: TeacherError("x: plain"),
    lambda: QuotaExceededError("x: over quota"),
    lambda: RuntimeError("x: a bug"),
]
VOCAB = 512


class FailingBackend(Backend):
    """Raises ``ERRORS[x[0]]()`` for a sequence ``x``; answers ``x[0] == 511`` (ids 0)."""

    def __init__(self) -> None:
        self.info = BackendInfo("failing", VOCAB, "f" * 64, 64, 0, "failing")

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        first = int(sequence.token_ids[0])
        if first < len(ERRORS):
            raise ERRORS[first]()
        n, k = sequence.end - sequence.start, options.top_k
        return SequenceArrays(
            np.zeros((n, k), np.int32),
            np.zeros((n, k), np.float32),
            np.zeros(n, np.float32),
            sequence.start,
        )


@pytest.fixture(scope="module")
def teacher() -> Iterator[LoopbackTeacher]:
    t = LoopbackTeacher(FailingBackend())
    yield t
    t.stop()


def _score(teacher: LoopbackTeacher, first: int) -> tuple[grpc.StatusCode, str, str]:
    """gRPC ``Score``: (code, message, reason)."""
    with pytest.raises(grpc.RpcError) as err:
        teacher.stub.Score(build_request([[first, 1, 2]], 4), timeout=30)
    e: Any = err.value
    reason = dict(e.trailing_metadata() or ()).get(REASON_KEY, "")
    return e.code(), e.details(), reason


def _stream(teacher: LoopbackTeacher, first: int) -> tuple[grpc.StatusCode, str, str]:
    """One failing request of a ``ScoreStream`` between two answered ones: the failed
    one's (code, message, reason); the stream goes on."""
    requests = [build_request([[f, 1, 2]], 4, request_id=str(f)) for f in (511, first, 511)]
    answers = list(teacher.stub.ScoreStream(iter(requests), timeout=30))
    by_id = {a.request_id: a for a in answers if a.final}
    assert set(by_id) == {"511", str(first)} and not by_id["511"].HasField("error")
    error = by_id[str(first)].error
    (code,) = [c for c in grpc.StatusCode if c.value[0] == error.code]
    return code, error.message, error.reason


def _http(teacher: LoopbackTeacher, first: int) -> tuple[int, dict[str, str]]:
    """TRL 1.10's ``POST /get_sequence_logprobs/``: (HTTP status, JSON body)."""
    body = {"sequences": [[first, 1, 2]], "prompt_lengths": [1], "top_logprobs": 4}
    req = urllib.request.Request(
        f"{teacher.http}/get_sequence_logprobs/", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _completions(f: int) -> dict[str, Any]:
    return {"prompt": [[f, 1, 2]], "prompt_logprobs": 4}


def _generate(f: int) -> dict[str, Any]:
    return {"input_ids": [f, 1, 2], "return_logprob": True, "logprob_start_len": 0}


def _token_generate(f: int) -> dict[str, Any]:
    return {"token_ids": [f, 1, 2], "sampling_params": {"prompt_logprobs": 4}}


def _nested(body: Any) -> str:
    return str(body["error"]["message"])


#: The other HTTP routes: path, body for a sequence starting with ``first``, where the
#: route's error shape holds the message.
ROUTES: list[tuple[str, Callable[[int], dict[str, Any]], Callable[[Any], str]]] = [
    ("/v1/completions", _completions, lambda body: str(body["error"])),
    ("/generate", _generate, _nested),
    ("/inference/v1/generate", _token_generate, _nested),
]


def _route(teacher: LoopbackTeacher, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(f"{teacher.http}{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _expected(first: int) -> tuple[grpc.StatusCode, str, str]:
    """The status, message and reason the one error table gives error kind ``first``."""
    error = ERRORS[first]()
    if not isinstance(error, TeacherError):
        return grpc.StatusCode.INTERNAL, f"teacher: scoring failed: {error}", ""
    code, reason = status_of(error)
    return code, error.message, reason


def _check_all_three(teacher: LoopbackTeacher, first: int) -> grpc.StatusCode:
    code, message, reason = _expected(first)
    assert _score(teacher, first) == (code, message, reason)
    assert _stream(teacher, first) == (code, message, reason)
    status, body = _http(teacher, first)
    assert (status, body) == (http_status(Status[code.name]), {"error": message, "code": code.name})
    for path, make, message_of in ROUTES:
        status, body = _route(teacher, path, make(first))
        assert (status, message_of(body)) == (http_status(Status[code.name]), message), path
    return code


@pytest.mark.parametrize("first", range(len(ERRORS)), ids=lambda i: type(ERRORS[i]()).__name__)
def test_every_error_kind_reaches_score_stream_and_http_alike(
    teacher: LoopbackTeacher, first: int
) -> None:
    _check_all_three(teacher, first)


def test_a_kind_added_to_the_error_table_once_reaches_all_three(
    teacher: LoopbackTeacher, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = next(i for i, e in enumerate(ERRORS) if isinstance(e(), QuotaExceededError))
    assert _check_all_three(teacher, first) is grpc.StatusCode.INTERNAL  # not in the table
    # One row added to the transport-free table (code_of reads it), nothing else:
    table = {**status_table._CODE_OF, QuotaExceededError: Status.PERMISSION_DENIED}
    monkeypatch.setattr(status_table, "_CODE_OF", table)
    assert _check_all_three(teacher, first) is grpc.StatusCode.PERMISSION_DENIED
    assert _http(teacher, first)[0] == 403


def test_outcomes_are_counted_under_their_front_end(teacher: LoopbackTeacher) -> None:
    requests = teacher.server.metrics.requests

    def count(method: str, code: str) -> float:
        return float(requests.labels(method, code)._value.get())

    before = [count(SEQUENCE_LOGPROBS_METHOD, "INVALID_ARGUMENT"), count("Score", "OK")]
    assert _http(teacher, 0)[0] == 400
    response = pb.ScoreResponse.FromString(
        teacher.stub.Score(build_request([[511, 1]], 4), timeout=30).SerializeToString()
    )
    assert response.final and response.sequences[0].num_positions == 2
    after = [count(SEQUENCE_LOGPROBS_METHOD, "INVALID_ARGUMENT"), count("Score", "OK")]
    assert after == [b + 1 for b in before]


# -- helpers --------------------------------------------------------------------------------
def test_gather_bounded_keeps_order_and_the_concurrency_limit() -> None:
    running = peak = 0

    async def one(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (x % 5))
        running -= 1
        return 2 * x

    n = 3 * MAX_SEQUENCES_IN_FLIGHT + 7
    assert asyncio.run(gather_bounded(one, list(range(n)))) == [2 * x for x in range(n)]
    assert peak == MAX_SEQUENCES_IN_FLIGHT


def test_gather_bounded_raises_the_first_error_and_cancels_the_rest() -> None:
    started = 0

    async def one(x: int) -> int:
        nonlocal started
        started += 1
        if x == 3:
            raise ValueError("sequence 3 failed")
        await asyncio.sleep(0.01)
        return x

    with pytest.raises(ValueError, match="sequence 3 failed"):
        asyncio.run(gather_bounded(one, list(range(5 * MAX_SEQUENCES_IN_FLIGHT))))
    assert started < 5 * MAX_SEQUENCES_IN_FLIGHT  # the rest were not started


def test_large_requests_are_validated_and_answered_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, str]] = []

    def spy(*args: object) -> object:
        seen.append(("parse", threading.current_thread().name))
        return parse_request(*args)  # type: ignore[arg-type]

    def finish(*_: object) -> str:
        seen.append(("finish", threading.current_thread().name))
        return "answer"

    monkeypatch.setattr(pipeline, "parse_request", spy)

    async def run(request: pb.ScoreRequest) -> object:
        lifecycle = Lifecycle()
        await lifecycle.advance(Phase.READY)
        metrics = TeacherMetrics()
        runner = RequestPipeline(
            FailingBackend(), Limits(vocab_size=VOCAB), metrics, lifecycle, AdmissionQueue(4, 4)
        )
        return await runner.run("test", request, finish)

    small = build_request([[511, 1, 2, 3]], 4)
    large = build_request([[511]] * 1000, 4)
    assert asyncio.run(run(small)) == Answered("answer")
    assert asyncio.run(run(large)) == Answered("answer")
    main = threading.main_thread().name
    assert seen[:2] == [("parse", main), ("finish", main)]
    assert [step for step, _ in seen[2:]] == ["parse", "finish"]
    assert all(thread != main for _, thread in seen[2:])


class DefaultOnlyBackend(FailingBackend):
    """A backend that answers the default encoding only."""

    @property
    def supported_encodings(self) -> tuple[str, ...]:
        return ("default",)


def test_an_encoding_the_backend_lacks_is_refused_and_the_pipeline_keeps_serving() -> None:
    async def run(request: pb.ScoreRequest) -> object:
        lifecycle = Lifecycle()
        await lifecycle.advance(Phase.READY)
        runner = RequestPipeline(
            DefaultOnlyBackend(),
            Limits(vocab_size=VOCAB),
            TeacherMetrics(),
            lifecycle,
            AdmissionQueue(4, 4),
        )
        refused = await runner.run("test", request, lambda *_: "answer")
        served = await runner.run("test", build_request([[511, 1]], 4), lambda *_: "answer")
        return refused, served

    refused, served = asyncio.run(run(build_request([[511, 1]], 4, encoding="packed")))
    assert isinstance(refused, Refused) and refused.code == Status.INVALID_ARGUMENT
    assert refused.message == "encoding: 'packed' is not served by this teacher; it serves default"
    assert served == Answered("answer")
