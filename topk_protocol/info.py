"""``GetInfo`` as a dataclass: what a teacher announces, and the schema check."""

from __future__ import annotations

from dataclasses import dataclass

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.codec import DTYPE_NAMES, SCHEMA_VERSION, dtype_name
from topk_protocol.errors import TeacherError

__all__ = ["TeacherInfo"]


@dataclass(frozen=True)
class TeacherInfo:
    """What the teacher announces (``GetInfo``); ``supported_dtypes`` are dtype names."""

    model_name: str
    vocab_size: int
    max_top_k: int
    tokenizer_fingerprint: str
    schema_version: int
    supported_dtypes: tuple[str, ...]
    backend: str
    max_tokens_per_request: int
    max_message_bytes: int
    max_sequence_length: int
    engine_dtype: str = ""  # what the engine computes in; empty for replay

    @classmethod
    def from_message(cls, msg: pb.TeacherInfo) -> TeacherInfo:
        known = set(DTYPE_NAMES.values())  # a newer teacher may list dtypes we do not know
        names = tuple(dtype_name(int(d)) for d in msg.supported_dtypes if int(d) in known)
        return cls(
            model_name=msg.model_name,
            vocab_size=int(msg.vocab_size),
            max_top_k=int(msg.max_top_k),
            tokenizer_fingerprint=msg.tokenizer_fingerprint,
            schema_version=int(msg.schema_version),
            supported_dtypes=names,
            backend=msg.backend,
            max_tokens_per_request=int(msg.max_tokens_per_request),
            max_message_bytes=int(msg.max_message_bytes),
            max_sequence_length=int(msg.max_sequence_length),
            engine_dtype=msg.engine_dtype,
        )

    def check_schema(self) -> None:
        """Raise :class:`TeacherError` when the teacher speaks another schema version."""
        if self.schema_version != SCHEMA_VERSION:
            raise TeacherError(
                f"schema_version: the teacher speaks {self.schema_version}, this client "
                f"speaks {SCHEMA_VERSION}"
            )
