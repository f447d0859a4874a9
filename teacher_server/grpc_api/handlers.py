"""Registers the Teacher servicer with request deserializers that never raise.

The generated ``add_TeacherServicer_to_server`` deserializes with ``FromString``: bytes
that do not parse fail inside gRPC with ``UNKNOWN`` ("Unexpected DecodeError"). Here a
message that does not parse becomes an :class:`Undecodable` request, which the request
pipeline answers with ``INVALID_ARGUMENT``; the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from teacher_server.validation import Undecodable
from topk_protocol import pb

__all__ = ["SERVICE_NAME", "Undecodable", "teacher_rpc_handler"]

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Teacher"].full_name  # topk_distill.v1.Teacher


def _tolerant(message_cls: type[Message]) -> Callable[[bytes], Any]:
    type_name = message_cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return Undecodable(type_name, len(data), e)

    return deserialize


def _serialize(message: Message | bytes) -> bytes:
    """A response message's bytes; the answers of ``Score`` and ``ScoreStream`` arrive
    serialized already (:mod:`teacher_server.grpc_api.answers`) and pass through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def teacher_rpc_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """The Teacher service's methods on ``servicer`` (GetInfo, Score, ScoreStream)."""
    handlers = {
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=_tolerant(pb.GetInfoRequest),
            response_serializer=pb.TeacherInfo.SerializeToString,
        ),
        "Score": grpc.unary_unary_rpc_method_handler(
            servicer.Score,
            request_deserializer=_tolerant(pb.ScoreRequest),
            response_serializer=_serialize,
        ),
        "ScoreStream": grpc.stream_stream_rpc_method_handler(
            servicer.ScoreStream,
            request_deserializer=_tolerant(pb.ScoreRequest),
            response_serializer=_serialize,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
