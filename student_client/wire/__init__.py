"""The wire format: generated protobuf/gRPC code and the array codec.

``pb`` is the generated message module, ``pb_grpc`` the generated service module.
"""

from student_client.wire._generated import teacher_pb2 as pb
from student_client.wire._generated import teacher_pb2_grpc as pb_grpc
from student_client.wire.codec import (
    DTYPE_NAMES,
    SCHEMA_VERSION,
    DecodedSequence,
    decode_sequence,
    decode_sequence_torch,
    decode_token_ids,
    dtype_from_name,
    dtype_name,
    encode_sequence,
    encode_token_ids,
    itemsize,
)

__all__ = [
    "DTYPE_NAMES",
    "SCHEMA_VERSION",
    "DecodedSequence",
    "decode_sequence",
    "decode_sequence_torch",
    "decode_token_ids",
    "dtype_from_name",
    "dtype_name",
    "encode_sequence",
    "encode_token_ids",
    "itemsize",
    "pb",
    "pb_grpc",
]
