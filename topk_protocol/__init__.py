"""The topk-distill protocol: the one place that knows the wire format and its rules.

The generated protobuf/gRPC code (``pb``, ``pb_grpc``), a sequence's payload arrays
(``SequenceArrays``) and their codec, request building, normalization, defaults and
sizes, the typed errors of gRPC statuses, and ``TeacherInfo``. Both ``teacher_server``
and ``student_client`` import it; it imports neither (checked by the import contracts
in ``pyproject.toml``). See ``docs/protocol.md``.
"""

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol._generated import teacher_pb2_grpc as pb_grpc
from topk_protocol.arrays import SequenceArrays
from topk_protocol.building import (
    build_request,
    normalize_sequences,
    request_spans,
    response_bytes,
    sequence_span,
)
from topk_protocol.codec import (
    DTYPE_NAMES,
    ENCODING_NAMES,
    SCHEMA_VERSION,
    decode_floats_into,
    decode_packed_into,
    decode_sequence,
    decode_sequence_into,
    decode_token_ids,
    dtype_from_name,
    dtype_name,
    encode_sequence,
    encode_token_ids,
    itemsize,
)
from topk_protocol.info import TeacherInfo
from topk_protocol.requests import (
    DEFAULT_DTYPE,
    DEFAULT_INCLUDE_SAMPLED,
    DEFAULT_MAX_MESSAGE_MB,
    FRAMING_BYTES,
    RECORDED,
    RequestOptions,
    Span,
    bytes_per_row,
    fits_one_message,
)
from topk_protocol.temperature import (
    DEFAULT_TEACHER_TEMPERATURE,
    check_temperature,
    teacher_temperature,
    temperature_mismatch,
)

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_INCLUDE_SAMPLED",
    "DEFAULT_MAX_MESSAGE_MB",
    "DEFAULT_TEACHER_TEMPERATURE",
    "DTYPE_NAMES",
    "ENCODING_NAMES",
    "FRAMING_BYTES",
    "RECORDED",
    "SCHEMA_VERSION",
    "RequestOptions",
    "SequenceArrays",
    "Span",
    "TeacherInfo",
    "build_request",
    "bytes_per_row",
    "check_temperature",
    "decode_floats_into",
    "decode_packed_into",
    "decode_sequence",
    "decode_sequence_into",
    "decode_token_ids",
    "dtype_from_name",
    "dtype_name",
    "encode_sequence",
    "encode_token_ids",
    "fits_one_message",
    "itemsize",
    "normalize_sequences",
    "pb",
    "pb_grpc",
    "request_spans",
    "response_bytes",
    "sequence_span",
    "teacher_temperature",
    "temperature_mismatch",
]
