"""``GetInfo`` as a dataclass: what a teacher announces, and the schema check."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from topk_protocol._generated import teacher_pb2 as pb
from topk_protocol.codec import DTYPE_NAMES, ENCODING_NAMES, SCHEMA_VERSION, dtype_name
from topk_protocol.errors import TeacherError, TeacherMismatchError, VocabMismatchError
from topk_protocol.fingerprint import AnswerFingerprint
from topk_protocol.temperature import DEFAULT_TEACHER_TEMPERATURE, teacher_temperature

__all__ = ["StudentTokenizerInfo", "TeacherInfo", "tokenizer_fingerprint"]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of a tokenizer's token -> id map (``tokenizer.get_vocab()``), which is
    what must match between a teacher and its student: what a teacher announces as
    :attr:`TeacherInfo.tokenizer_fingerprint`, and what a student computes to compare."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class StudentTokenizerInfo:
    """A student tokenizer a teacher serves (``ScoreRequest.student_tokenizer``)."""

    name: str
    vocab_size: int
    tokenizer_fingerprint: str


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
    teacher_temperature: float = DEFAULT_TEACHER_TEMPERATURE
    #: Largest C of candidate ids per position it scores (0: none; an older teacher).
    max_candidates: int = 0
    #: Payload encodings the teacher answers (an older teacher announces none: default).
    supported_encodings: tuple[str, ...] = ("default",)
    max_samples: int = 0  # largest sampled-payload N (0: none)
    #: Its answers to the canary sequences (None: an older teacher, or replay;
    #: topk_protocol.fingerprint).
    answer_fingerprint: AnswerFingerprint | None = field(default=None, compare=False)
    #: The student tokenizers it also answers (docs/cross_tokenizer.md; none: an older
    #: teacher, or one serving only its own).
    student_tokenizers: tuple[StudentTokenizerInfo, ...] = ()

    @classmethod
    def from_message(cls, msg: pb.TeacherInfo) -> TeacherInfo:
        known = set(DTYPE_NAMES.values())  # a newer teacher may list dtypes we do not know
        names = tuple(dtype_name(int(d)) for d in msg.supported_dtypes if int(d) in known)
        by_value = {v: k for k, v in ENCODING_NAMES.items()}
        encodings = tuple(by_value[int(e)] for e in msg.supported_encodings if int(e) in by_value)
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
            teacher_temperature=teacher_temperature(msg),
            max_candidates=int(msg.max_candidates),
            supported_encodings=encodings or ("default",),
            max_samples=int(msg.max_samples),
            answer_fingerprint=AnswerFingerprint.of_info(msg),
            student_tokenizers=tuple(
                StudentTokenizerInfo(s.name, int(s.vocab_size), s.tokenizer_fingerprint)
                for s in msg.student_tokenizers
            ),
        )

    def for_student(self, name: str | None) -> TeacherInfo:
        """This teacher as a student of tokenizer ``name`` sees it: the vocabulary size and
        fingerprint its ids and answers have are that tokenizer's (None: the teacher's
        own, unchanged). Raises :class:`TeacherMismatchError` naming
        ``student_tokenizer`` when the teacher does not serve ``name``."""
        if name is None:
            return self
        for student in self.student_tokenizers:
            if student.name == name:
                return replace(
                    self,
                    vocab_size=student.vocab_size,
                    tokenizer_fingerprint=student.tokenizer_fingerprint,
                )
        served = ", ".join(repr(s.name) for s in self.student_tokenizers) or "none"
        raise TeacherMismatchError(
            f"student_tokenizer: {name!r} is not served by teacher {self.model_name!r} "
            f"(it serves: {served}; its --student-tokenizer flag adds one)"
        )

    def check_schema(self) -> None:
        """Raise :class:`TeacherError` when the teacher speaks another schema version."""
        if self.schema_version != SCHEMA_VERSION:
            raise TeacherError(
                f"schema_version: the teacher speaks {self.schema_version}, this client "
                f"speaks {SCHEMA_VERSION}"
            )

    def check_expected(
        self,
        source: str,
        *,
        vocab_size: int | None = None,
        tokenizer_fingerprint: str | None = None,
        temperature: float | None = None,
    ) -> None:
        """Raise unless the teacher is what the student expects (None: anything goes).

        A vocabulary problem raises :class:`VocabMismatchError`; a temperature problem
        alone :class:`TeacherMismatchError`. The message names ``source`` and each field.
        """
        problems = []
        if vocab_size is not None and self.vocab_size != vocab_size:
            problems.append(
                f"vocab_size: the teacher has {self.vocab_size}, the student expects {vocab_size}"
            )
        fp = self.tokenizer_fingerprint
        if tokenizer_fingerprint is not None and fp != tokenizer_fingerprint:
            problems.append(
                f"tokenizer_fingerprint: the teacher has {fp!r}, "
                f"the student expects {tokenizer_fingerprint!r}"
            )
        vocab_problem = bool(problems)
        if temperature is not None and self.teacher_temperature != temperature:
            problems.append(
                f"teacher_temperature: the teacher serves T = {self.teacher_temperature:g}, "
                f"the student expects T = {temperature:g}"
            )
        if problems:
            error = VocabMismatchError if vocab_problem else TeacherMismatchError
            raise error(f"{source}: " + "; ".join(problems))
