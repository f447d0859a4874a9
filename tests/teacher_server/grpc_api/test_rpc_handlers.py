"""Undecodable request bytes on every Teacher method: INVALID_ARGUMENT naming the message
type, and the server keeps serving (the session's vLLM teacher, through a raw channel)."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from teacher_server.grpc_api.handlers import SERVICE_NAME
from topk_protocol import encode_token_ids, pb, pb_grpc

METHODS = {
    "GetInfo": pb.GetInfoRequest,
    "Score": pb.ScoreRequest,
    "ScoreStream": pb.ScoreRequest,
}


def undecodable(message_cls: type, rng: random.Random, n: int = 5) -> list[bytes]:
    """Random byte strings that ``message_cls`` cannot parse (checked here)."""
    out: list[bytes] = []
    while len(out) < n:
        data = rng.randbytes(rng.randint(1, 64))
        try:
            message_cls.FromString(data)
        except DecodeError:
            out.append(data)
    return out


def test_every_teacher_method_is_covered() -> None:
    service = pb.DESCRIPTOR.services_by_name["Teacher"]
    assert service.full_name == SERVICE_NAME
    assert {m.name: m.input_type.full_name for m in service.methods} == {
        name: cls.DESCRIPTOR.full_name for name, cls in METHODS.items()
    }


@pytest.mark.vllm
def test_random_bytes_get_invalid_argument(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    with grpc.insecure_channel(vllm_teacher.target) as ch:
        for name, cls in METHODS.items():
            path = f"/{SERVICE_NAME}/{name}"
            for data in undecodable(cls, rng):
                with pytest.raises(grpc.RpcError) as err:
                    if name == "ScoreStream":
                        call = ch.stream_stream(path)  # raw bytes both ways
                        list(call(iter([data]), timeout=30))
                    else:
                        ch.unary_unary(path)(data, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, data)
                assert f"not a valid {cls.DESCRIPTOR.full_name}" in err.value.details()
        good = pb.ScoreRequest(
            request_id="ok",
            top_k=4,
            sequences=[pb.SequenceRequest(token_ids=encode_token_ids(np.arange(8)))],
        )
        # Still serving, on the same connection.
        stub = pb_grpc.TeacherStub(ch)
        assert stub.Score(good, timeout=60).sequences[0].num_positions == 8
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=30).vocab_size > 0
