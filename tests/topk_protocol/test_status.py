"""The one table between typed errors and gRPC statuses, both ways: what the servicer
sends for each error kind, what the client turns each status back into, and NOT_FOUND
as NotRecordedError only when the reason says it is about a recording."""

from __future__ import annotations

import grpc
import pytest

from topk_protocol.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NotRecordedError,
    RecordingError,
    ResourceExhaustedError,
    TeacherError,
    TeacherMismatchError,
    TeacherUnavailableError,
    UnauthenticatedError,
    VocabMismatchError,
)
from topk_protocol.status import error_from_code, status_of


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidRequestError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.PERMISSION_DENIED, UnauthenticatedError),
        (grpc.StatusCode.UNAVAILABLE, TeacherUnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, TeacherError),
    ],
)
def test_status_codes_map_to_typed_errors(code: grpc.StatusCode, cls: type) -> None:
    for value in (code, code.value[0]):
        err = error_from_code(value, "the message")
        assert type(err) is cls and err.code == code
        assert "the message" in str(err)


def test_not_found_is_not_recorded_only_with_its_reason() -> None:
    recorded = error_from_code(
        grpc.StatusCode.NOT_FOUND, "recording r: not recorded", "not_recorded"
    )
    assert type(recorded) is NotRecordedError and recorded.message == "recording r: not recorded"
    other = error_from_code(grpc.StatusCode.NOT_FOUND, "no such model")
    assert type(other) is TeacherError
    assert other.message == "teacher error NOT_FOUND: no such model"
    # A reason that does not belong to the code does not change the mapping.
    odd = error_from_code(grpc.StatusCode.INVALID_ARGUMENT, "top_k: 0", "not_recorded")
    assert type(odd) is InvalidRequestError


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("top_k: 0 is outside [1, 64] (max_top_k)"),
        ResourceExhaustedError("sequences: 70000 tokens"),
        TeacherUnavailableError("teacher: loading"),
        NotRecordedError("recording r: not recorded"),
        DeadlineExceededError("late"),
        UnauthenticatedError("no token"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_the_server_sends_comes_back_as_the_same_kind(error: TeacherError) -> None:
    code, reason = status_of(error)
    back = error_from_code(code, error.message, reason)
    assert type(back) is type(error) and back.message == error.message and back.code == code


def test_errors_of_no_listed_kind_go_out_as_internal() -> None:
    assert status_of(TeacherError("x")) == (grpc.StatusCode.INTERNAL, "")
    assert status_of(RecordingError("r", 3, "cut short"))[0] == grpc.StatusCode.INTERNAL
    # Subclasses take their base's code: a vocabulary mismatch is a mismatch.
    assert status_of(VocabMismatchError("v")) == status_of(TeacherMismatchError("t"))


def test_one_argument_order() -> None:
    err = InvalidRequestError("top_k: bad", grpc.StatusCode.INVALID_ARGUMENT)
    assert (err.message, err.code) == ("top_k: bad", grpc.StatusCode.INVALID_ARGUMENT)
    assert isinstance(err, ValueError)
