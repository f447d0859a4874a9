"""Student tokenizers: the teacher answering a student of another tokenizer.

``teacher-server serve --student-tokenizer NAME=DIR`` (repeatable; ``DIR`` a tokenizer
directory as ``transformers`` saves it) makes the server answer requests whose
``student_tokenizer`` is ``NAME``: their ids are that tokenizer's, and so are the
answer's (docs/cross_tokenizer.md). At start-up each student tokenizer is loaded and its
byte table built (a tokenizer whose bytes cannot be known is refused then, naming the
flag and why); once the engine is up, the teacher's table and each pair's vocabulary map
(:meth:`StudentTokenizers.pair`). A request then goes (:meth:`StudentTokenizers.score`):

1. student ids -> their bytes -> text (UTF-8) -> the teacher's tokens, with the special
   tokens the teacher's tokenizer puts first (its BOS, zero bytes) and a space it may
   prepend; the teacher's bytes must be the student's (a refusal naming the sequence
   otherwise);
2. the teacher scores the teacher rows the asked student rows read (prefix reuse applies
   as to any request: it is an ordinary request of teacher tokens);
3. the student rows (:func:`teacher_server.alignment.rows.student_rows`): projected top-k,
   chain-rule actual-token log-probs, masked rows; their kinds ride along in the
   server-only ``SequenceArrays.row_kinds`` for the answer's counts and ``/metrics``.

The tokenizer work and the numpy steps run in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.alignment import (
    Alignment,
    TokenBytes,
    VocabMap,
    align_lengths,
    build_vocab_map,
    token_bytes,
)
from teacher_server.alignment.rows import student_rows, teacher_candidates, teacher_span
from teacher_server.config import STUDENT_TOKENIZER_FLAG, student_tokenizer_spec
from teacher_server.validation import Limits, ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays, pb
from topk_protocol.errors import InvalidRequestError
from topk_protocol.info import tokenizer_fingerprint

__all__ = ["AlignedSequence", "StudentTokenizer", "StudentTokenizers"]

FLAG = STUDENT_TOKENIZER_FLAG  # in messages

#: How the teacher scores a sequence of its own tokens.
ScoreFn = Callable[[ParsedSequence, RequestOptions], Awaitable[SequenceArrays]]


@dataclass(frozen=True, eq=False)
class StudentTokenizer:
    """One served student tokenizer: its name, ``transformers`` tokenizer, fingerprint
    and byte table; once paired with the teacher, ``vocab_map`` (teacher ids -> its ids)
    and ``to_teacher`` (``[Vs]``: the teacher id of each of its ids, -1 where its bytes
    are not one teacher token)."""

    name: str
    tokenizer: Any
    fingerprint: str
    table: TokenBytes
    vocab_map: VocabMap | None = None
    to_teacher: npt.NDArray[np.int32] | None = None

    @property
    def vocab_size(self) -> int:
        """``Vs``: its ids are ``[0, Vs)``."""
        return self.table.vocab_size

    def info(self) -> pb.StudentTokenizerInfo:
        return pb.StudentTokenizerInfo(
            name=self.name, vocab_size=self.vocab_size, tokenizer_fingerprint=self.fingerprint
        )


@dataclass(frozen=True, eq=False)
class AlignedSequence:
    """A student sequence spelled in the teacher's tokens: ``teacher_ids`` ``[Lt]`` and
    the rows' :class:`~teacher_server.alignment.Alignment`."""

    teacher_ids: npt.NDArray[np.int32]
    alignment: Alignment


@dataclass(frozen=True, eq=False)
class _Teacher:
    """The teacher's side of every pair: its tokenizer, byte table and the special ids its
    tokenizer puts before a text."""

    tokenizer: Any
    table: TokenBytes
    prefix: npt.NDArray[np.int32]


def _load(name: str, path: Path) -> StudentTokenizer:
    from transformers import AutoTokenizer

    spec = f"{name}={path}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds: say which, keep the reason
        raise ValueError(f"{FLAG} {spec!r}: not a tokenizer directory ({e})") from None
    try:
        table = token_bytes(tokenizer)
    except ValueError as e:
        raise ValueError(f"{FLAG} {spec!r}: unsupported tokenizer: {e}") from None
    return StudentTokenizer(name, tokenizer, tokenizer_fingerprint(tokenizer), table)


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """``text``'s ids by the ``tokenizers`` object behind ``tokenizer``: its ``encode``
    changes no state, so worker threads may call it at once (the ``transformers`` call
    sets truncation and padding on it first, which two threads must not do together)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    ids: list[int] = backend.encode(text, add_special_tokens=add_special_tokens).ids
    return ids


def _prefix_ids(tokenizer: Any) -> npt.NDArray[np.int32]:
    """The special ids ``tokenizer`` puts before a text (its BOS; none for most)."""
    probe = "a"
    plain = _encode(tokenizer, probe)
    full = _encode(tokenizer, probe, add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return np.asarray(full[:i], dtype=np.int32)
    return np.zeros(0, dtype=np.int32)


class StudentTokenizers:
    """The server's student tokenizers by name (none: every request is the teacher's).

    Args:
        specs: ``NAME=DIR`` each (:func:`~teacher_server.config.student_tokenizer_spec`);
            each tokenizer is loaded and its byte table built now. ``ValueError`` naming
            the flag and the value for a missing directory, a directory without a
            tokenizer, an unsupported tokenizer (its bytes cannot be known, e.g.
            WordPiece) or a name given twice.
    """

    def __init__(self, specs: Iterable[str] = ()) -> None:
        self._students: dict[str, StudentTokenizer] = {}
        for spec in specs:
            name, path = student_tokenizer_spec(spec)
            if name in self._students:
                raise ValueError(f"{FLAG} {spec!r}: the name {name!r} is given twice")
            self._students[name] = _load(name, path)
        self._teacher: _Teacher | None = None

    def __bool__(self) -> bool:
        return bool(self._students)

    @property
    def names(self) -> list[str]:
        return sorted(self._students)

    def pair(self, teacher_tokenizer: Any, teacher_vocab_size: int) -> None:
        """Build the teacher's byte table and each student's vocabulary map (once, when
        the engine is up). ``ValueError`` naming the flag when the teacher's tokenizer is
        unknown or unsupported."""
        if not self._students:
            return
        if teacher_tokenizer is None:
            raise ValueError(f"{FLAG}: the teacher's backend has no tokenizer to align with")
        try:
            table = token_bytes(teacher_tokenizer, teacher_vocab_size)
        except ValueError as e:
            raise ValueError(f"{FLAG}: the teacher's tokenizer is unsupported: {e}") from None
        self._teacher = _Teacher(teacher_tokenizer, table, _prefix_ids(teacher_tokenizer))
        own = tokenizer_fingerprint(teacher_tokenizer)
        for name, student in self._students.items():
            if student.fingerprint == own:
                # The teacher's own tokenizer: every id is itself, the model's ids beyond
                # the tokenizer's included (they have no bytes to match by).
                student = replace(student, table=table)
                identity = np.arange(table.vocab_size, dtype=np.int32)
                vocab_map = VocabMap(identity, table.vocab_size)
            else:
                vocab_map = build_vocab_map(table, student.table)
            to_teacher = np.full(student.vocab_size, -1, dtype=np.int32)
            mapped = np.flatnonzero(vocab_map.teacher_to_student >= 0)
            to_teacher[vocab_map.teacher_to_student[mapped]] = mapped
            self._students[name] = replace(student, vocab_map=vocab_map, to_teacher=to_teacher)

    def info(self) -> list[pb.StudentTokenizerInfo]:
        """``TeacherInfo.student_tokenizers``, by name."""
        return [self._students[n].info() for n in self.names]

    def get(self, name: str) -> StudentTokenizer:
        """The student tokenizer ``name``; ``InvalidRequestError`` naming the field and
        the names served."""
        student = self._students.get(name)
        if student is None:
            served = ", ".join(repr(n) for n in self.names) or "none"
            raise InvalidRequestError(
                f"student_tokenizer: {name!r} is not served here (served: {served}; the "
                f"server's {FLAG} flag adds one)"
            )
        return student

    def limits(self, name: str, limits: Limits) -> Limits:
        """``limits`` for a request of student tokenizer ``name``: its vocabulary."""
        return replace(limits, vocab_size=self.get(name).vocab_size)

    def align(self, name: str, student_ids: npt.NDArray[np.int32], field: str) -> AlignedSequence:
        """Spell ``student_ids`` ``[Ls]`` in the teacher's tokens and align the rows.
        ``InvalidRequestError`` naming ``field`` when the student's bytes are not UTF-8
        text or the teacher's tokenizer does not spell exactly them."""
        student, teacher = self.get(name), self._paired()
        s_bytes = student.table.join(student_ids)
        try:
            text = s_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(
                f"{field}: the student's tokens spell bytes that are not UTF-8 text (byte "
                f"{e.start}: {e.reason}); the teacher's tokenizer reads text"
            ) from None
        body = np.asarray(_encode(teacher.tokenizer, text), dtype=np.int32)
        t_bytes = teacher.table.join(body)
        offset = len(t_bytes) - len(s_bytes)  # 1: a space the tokenizer prepends
        prepended = t_bytes[: max(offset, 0)]
        if offset not in (0, 1) or prepended not in (b"", b" ") or t_bytes[offset:] != s_bytes:
            raise InvalidRequestError(
                f"{field}: the teacher's tokenizer does not reproduce the student's "
                f"{len(s_bytes)} bytes (it spells {len(t_bytes)}, first difference at byte "
                f"{_first_difference(t_bytes[max(offset, 0) :], s_bytes)}); such a sequence "
                "cannot be aligned"
            )
        teacher_ids = np.concatenate([teacher.prefix, body])
        teacher_lengths = np.concatenate(
            [np.zeros(len(teacher.prefix), np.int64), teacher.table.lengths[body]]
        )
        alignment = align_lengths(
            student.table.lengths[student_ids], teacher_lengths, student_offset=offset
        )
        return AlignedSequence(teacher_ids, alignment)

    async def score(
        self,
        sequence: ParsedSequence,
        options: RequestOptions,
        score: ScoreFn,
        *,
        field: str,
        max_sequence_length: int = 0,
    ) -> SequenceArrays:
        """The student rows ``[start, end)`` of ``sequence`` (student ids) for
        ``options.student_tokenizer``, the teacher's rows from ``score``."""
        name = options.student_tokenizer
        if name is None:
            raise ValueError("options.student_tokenizer: None (not a student's request)")
        aligned = await asyncio.to_thread(self.align, name, sequence.token_ids, field)
        n = len(aligned.teacher_ids)
        if max_sequence_length and n > max_sequence_length:
            raise InvalidRequestError(
                f"{field}: spelled in the teacher's tokens it is {n} tokens, over the "
                f"teacher's max_sequence_length {max_sequence_length}"
            )
        ts, te = teacher_span(aligned.alignment, sequence.start, sequence.end)
        teacher_options = replace(options, student_tokenizer=None, include_sampled=True)
        student = self.get(name)
        asked = self._candidates(student, aligned, sequence, field)
        if ts < te:
            parsed = ParsedSequence(
                aligned.teacher_ids, ts, te, None if asked is None else asked[0]
            )
            rows = await score(parsed, teacher_options)
        else:  # every asked row is masked: nothing for the engine to do
            rows = SequenceArrays.empty(options.top_k, ts, None if asked is None else 0)
        if rows.sampled_logprobs is None:
            raise RuntimeError("the backend gave no actual-token log-probs")
        vocab_map = student.vocab_map
        if vocab_map is None:
            raise RuntimeError("student tokenizers: pair() was not called")
        got = await asyncio.to_thread(
            student_rows,
            aligned.alignment,
            sequence.start,
            sequence.end,
            (rows.ids, rows.logprobs, rows.sampled_logprobs),
            ts,
            vocab_map,
            aligned.teacher_ids,
        )
        candidate_logprobs = None
        if asked is not None:
            index, teacher_lps = asked[1], rows.candidate_logprobs
            shape = (len(index), asked[0].shape[1])  # [S, C]
            candidate_logprobs = np.full(shape, np.nan, np.float32)
            if teacher_lps is not None:
                read = index >= 0
                candidate_logprobs[read] = teacher_lps[index[read]]
        return SequenceArrays(
            got.ids,
            got.logprobs,
            got.sampled_logprobs,
            sequence.start,
            candidate_ids=sequence.candidate_ids,
            candidate_logprobs=candidate_logprobs,
            row_kinds=got.kinds,
        )

    @staticmethod
    def _candidates(
        student: StudentTokenizer,
        aligned: AlignedSequence,
        sequence: ParsedSequence,
        field: str,
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]] | None:
        """The request's candidate ids as the teacher rows ask for them, and each student
        row's index into those (:func:`~teacher_server.alignment.rows.teacher_candidates`);
        None without candidates. ``InvalidRequestError`` naming the candidate otherwise."""
        if sequence.candidate_ids is None:
            return None
        if student.to_teacher is None:
            raise RuntimeError("student tokenizers: pair() was not called")
        name = f"{field.rsplit('.', 1)[0]}.candidate_ids"
        try:
            return teacher_candidates(
                aligned.alignment,
                sequence.start,
                sequence.end,
                sequence.candidate_ids,
                student.to_teacher,
            )
        except ValueError as e:
            where = str(e)
            raise InvalidRequestError(
                f"{name}{where}" if where.startswith("[") else f"{name}: {where}"
            ) from None

    def _paired(self) -> _Teacher:
        if self._teacher is None:
            raise RuntimeError("student tokenizers: pair() was not called")
        return self._teacher


def _first_difference(a: bytes, b: bytes) -> int:
    """The first byte at which ``a`` and ``b`` differ (the shorter's length if one is a
    prefix of the other)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.frombuffer(a[:n], np.uint8) != np.frombuffer(b[:n], np.uint8))
    return int(diff[0]) if diff.size else n
