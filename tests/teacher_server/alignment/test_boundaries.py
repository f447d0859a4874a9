"""Student rows against teacher rows by byte offsets, checked against a plain-loop
reference of the definition (docs/cross_tokenizer.md) and on real tokenizers."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from teacher_server.alignment.boundaries import RowKind, align_lengths, align_tokens
from teacher_server.alignment.token_bytes import token_bytes
from tests.teacher_server.alignment.tokenizer_cases import (
    MULTIBYTE,
    TEXTS,
    bpe,
    byte_level,
    sentencepiece,
    texts,
)

M, B, A = RowKind.MASKED, RowKind.BOUNDARY, RowKind.ALIGNED


def reference(
    student_lengths: list[int], teacher_lengths: list[int], offset: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """``(teacher_row, kind, chain_stop)`` by the definition, one position at a time.

    Student row ``t`` is the distribution after the student's first ``t + 1`` tokens,
    which end ``offset + sum(student_lengths[:t+1])`` bytes into the teacher's bytes.
    Its teacher row is the last teacher row whose prefix has exactly as many bytes; it
    is aligned when the next student token has bytes and its end has a teacher row too.
    """
    teacher_prefix = [sum(teacher_lengths[: j + 1]) for j in range(len(teacher_lengths))]
    rows = []
    for t in range(len(student_lengths)):
        end = offset + sum(student_lengths[: t + 1])
        matches = [j for j, e in enumerate(teacher_prefix) if e == end]
        rows.append(matches[-1] if matches else -1)
    kinds, stops = [], []
    for t, row in enumerate(rows):
        nxt = t + 1 < len(rows) and rows[t + 1] >= 0 and student_lengths[t + 1] > 0
        if row < 0:
            kinds.append(int(M))
            stops.append(-1)
        elif nxt:
            kinds.append(int(A))
            stops.append(rows[t + 1])
        else:
            kinds.append(int(B))
            stops.append(-1)
    return rows, kinds, stops


def check(student_lengths: list[int], teacher_lengths: list[int], offset: int = 0) -> None:
    a = align_lengths(student_lengths, teacher_lengths, student_offset=offset)
    rows, kinds, stops = reference(student_lengths, teacher_lengths, offset)
    assert a.teacher_row.tolist() == rows
    assert a.kind.tolist() == kinds
    assert a.chain_stop.tolist() == stops
    assert a.student_ends.tolist() == [
        offset + sum(student_lengths[: t + 1]) for t in range(len(student_lengths))
    ]
    assert a.teacher_ends.dtype == np.int64 and a.kind.dtype == np.int8


@pytest.mark.parametrize(
    ("student", "teacher", "offset", "rows", "kinds"),
    [
        # the module doc: a | bcd | e | f | g  against  a | b | c | d | efg
        ([1, 3, 1, 1, 1], [1, 1, 1, 1, 3], 0, [0, 3, -1, -1, 4], [A, B, M, M, B]),
        # a student token spanning three teacher tokens, in the middle
        ([1, 3, 1], [1, 1, 1, 1, 1], 0, [0, 3, 4], [A, A, B]),
        # a teacher token spanning three student tokens, in the middle
        ([1, 1, 1, 1, 1], [1, 3, 1], 0, [0, -1, -1, 1, 2], [B, M, M, A, B]),
        # the student starts mid-teacher-token (its bytes from the teacher's byte 1)
        ([1, 1, 2], [3, 2], 1, [-1, 0, 1], [M, A, B]),
        # the first student row ends inside the first teacher token
        ([1, 2, 2], [3, 2], 0, [-1, 0, 1], [M, A, B]),
        # the student ends mid-teacher-token (the teacher reads on)
        ([2, 2], [2, 3], 0, [0, -1], [B, M]),
        # the student reads past the teacher's last byte
        ([2, 2, 1], [2, 2], 0, [0, 1, -1], [A, B, M]),
        # identity
        ([2, 1, 3, 1], [2, 1, 3, 1], 0, [0, 1, 2, 3], [A, A, A, B]),
        # a BOS of zero bytes on both sides: student row 0 is the teacher's row after BOS
        ([0, 2, 1], [0, 1, 1, 1], 0, [0, 2, 3], [A, A, B]),
        # a student BOS, none in the teacher: no teacher row at the empty prefix
        ([0, 2], [2], 0, [-1, 0], [M, B]),
        # a teacher BOS only
        ([2], [0, 2], 0, [1], [B]),
        # a zero-byte student token in the middle is never the aligned next token
        ([1, 0, 1], [1, 1], 0, [0, 0, 1], [B, A, B]),
        # no teacher tokens, no student tokens
        ([1, 1], [], 0, [-1, -1], [M, M]),
        ([], [1, 2], 0, [], []),
    ],
)
def test_worked_cases(
    student: list[int], teacher: list[int], offset: int, rows: list[int], kinds: list[RowKind]
) -> None:
    a = align_lengths(student, teacher, student_offset=offset)
    assert a.teacher_row.tolist() == rows
    assert a.kind.tolist() == [int(k) for k in kinds]
    check(student, teacher, offset)


def test_chain_stops_of_the_module_doc() -> None:
    a = align_lengths([1, 3, 1, 1, 1], [1, 1, 1, 1, 3])
    assert a.chain_stop.tolist() == [3, -1, -1, -1, -1]
    assert a.boundary.tolist() == [True, True, False, False, True]
    assert a.aligned.tolist() == [True, False, False, False, False]


@settings(max_examples=examples(300))
@given(
    student=st.lists(st.integers(0, 4), max_size=12),
    teacher=st.lists(st.integers(0, 4), max_size=12),
    offset=st.integers(0, 3),
)
@example(student=[1] * 5, teacher=[5], offset=0)
@example(student=[5], teacher=[1] * 5, offset=0)
def test_any_lengths_match_the_reference(
    student: list[int], teacher: list[int], offset: int
) -> None:
    check(student, teacher, offset)


@st.composite
def two_segmentations(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Two tokenizations of the same ``n`` bytes (so most rows meet a teacher end)."""
    n = draw(st.integers(0, 24))

    def lengths() -> list[int]:
        cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n)) - {n})
        bounds = [0, *(c for c in cuts if c < n), n] if n else []
        return [b - a for a, b in itertools.pairwise(bounds)]

    return lengths(), lengths()


@settings(max_examples=examples(300))
@given(pair=two_segmentations())
def test_two_segmentations_of_the_same_bytes(pair: tuple[list[int], list[int]]) -> None:
    student, teacher = pair
    check(student, teacher)
    if student:
        a = align_lengths(student, teacher)
        assert a.kind[-1] == B  # both end at the last byte
        assert a.teacher_row[-1] == len(teacher) - 1


def _identity_check(lengths: list[int]) -> None:
    a = align_lengths(lengths, lengths)
    assert a.teacher_row.tolist() == list(range(len(lengths)))
    assert a.kind.tolist() == [int(A)] * (len(lengths) - 1) + [int(B)] * bool(lengths)


@settings(max_examples=examples(100))
@given(lengths=st.lists(st.integers(1, 6), max_size=20))
def test_identity(lengths: list[int]) -> None:
    _identity_check(lengths)


def test_invalid_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"student_lengths.*>= 0"):
        align_lengths([1, -1], [0])
    with pytest.raises(ValueError, match=r"teacher_lengths.*integers"):
        align_lengths([1], [1.5])
    with pytest.raises(ValueError, match=r"student_lengths.*\[L\]"):
        align_lengths([[1]], [1])
    with pytest.raises(ValueError, match="student_offset"):
        align_lengths([1], [1], student_offset=-1)


# -- real tokenizers ----------------------------------------------------------------------


def _prefix_check(student_bytes: bytes, teacher_bytes: bytes, s_lens, t_lens, a, offset=0) -> None:
    """Row ``t`` with a teacher row ``j``: the teacher's first ``j + 1`` tokens spell the
    teacher's bytes up to the student's first ``t + 1`` tokens' end; masked rows: no
    teacher prefix ends there."""
    teacher_prefixes = {sum(t_lens[: j + 1]): j for j in range(len(t_lens))}
    for t in range(len(s_lens)):
        end = offset + sum(s_lens[: t + 1])
        j = int(a.teacher_row[t])
        if j >= 0:
            assert sum(t_lens[: j + 1]) == end
            assert teacher_bytes[:end] == teacher_bytes[:offset] + student_bytes[: end - offset]
        else:
            assert end not in teacher_prefixes


PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "byte-bpe4096": (byte_level, lambda: bpe(4096)),
    "bpe1000-bpe4096": (lambda: bpe(1000), lambda: bpe(4096)),
    "bpe4096-byte": (lambda: bpe(4096), byte_level),
    "bpe4096-bpe4096": (lambda: bpe(4096), lambda: bpe(4096)),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_real_tokenizers(pair: str, text: str) -> None:
    student_tok, teacher_tok = (f() for f in PAIRS[pair])
    s_table, t_table = token_bytes(student_tok), token_bytes(teacher_tok)
    s_ids = student_tok.encode(text)
    t_ids = teacher_tok.encode(text)
    a = align_tokens(s_ids, t_ids, s_table, t_table)
    s_lens = s_table.lengths[s_ids].tolist()
    t_lens = t_table.lengths[t_ids].tolist()
    check(s_lens, t_lens)
    _prefix_check(text.encode(), text.encode(), s_lens, t_lens, a)
    if student_tok is teacher_tok:
        _identity_check(s_lens)
    if pair == "byte-bpe4096":
        # every teacher end is a byte, so a student end: each teacher row is one student row
        assert sorted(a.teacher_row[a.boundary].tolist()) == list(range(len(t_ids)))


@settings(max_examples=examples(60))
@given(text=texts())
def test_real_tokenizers_on_any_text(text: str) -> None:
    import unicodedata

    text = unicodedata.normalize("NFC", text)
    s_tok, t_tok = bpe(1000), bpe(4096)
    s_ids, t_ids = s_tok.encode(text), t_tok.encode(text)
    a = align_tokens(s_ids, t_ids, token_bytes(s_tok), token_bytes(t_tok))
    check(token_bytes(s_tok).lengths[s_ids].tolist(), token_bytes(t_tok).lengths[t_ids].tolist())
    assert a.kind.shape == (len(s_ids),)


def test_multibyte_characters_split_differently() -> None:
    """The byte student splits every character into its bytes; a row inside a character
    is masked against a teacher that holds the character whole."""
    s_tok, t_tok = byte_level(), bpe(4096)
    s_ids, t_ids = s_tok.encode(MULTIBYTE), t_tok.encode(MULTIBYTE)
    a = align_tokens(s_ids, t_ids, token_bytes(s_tok), token_bytes(t_tok))
    raw = MULTIBYTE.encode()
    # byte student row t ends at byte t + 1; the teacher's last token is " 🙂" (5 bytes)
    assert t_ids[-1] == t_tok.convert_tokens_to_ids("Ġ" + "ðŁĻĤ")
    inside = [len(raw) - 4, len(raw) - 3, len(raw) - 2, len(raw) - 1]
    assert not set(inside) & set(a.teacher_ends.tolist())
    assert a.kind[[e - 1 for e in inside]].tolist() == [M, M, M, M]
    assert a.kind[-1] == B
    assert a.kind[len(raw) - 5 - 1] == B  # after "語": a teacher end, next byte " " inside


def test_a_teacher_that_prepends_a_space() -> None:
    """A SentencePiece teacher spells ``' ' + text``: the student's bytes start at the
    teacher's byte 1."""
    s_tok, t_tok = byte_level(), sentencepiece("first")
    text = "héllo wörld"
    s_ids = s_tok.encode(text)
    t_ids = t_tok.encode(text, add_special_tokens=False)
    s_table, t_table = token_bytes(s_tok), token_bytes(t_tok)
    with pytest.raises(ValueError, match="not the teacher's bytes from offset 0"):
        align_tokens(s_ids, t_ids, s_table, t_table)
    a = align_tokens(s_ids, t_ids, s_table, t_table, student_offset=1)
    check(s_table.lengths[s_ids].tolist(), t_table.lengths[t_ids].tolist(), 1)
    _prefix_check(
        text.encode(),
        b" " + text.encode(),
        s_table.lengths[s_ids].tolist(),
        t_table.lengths[t_ids].tolist(),
        a,
        offset=1,
    )
    # ' h' is one teacher token: the student's row 0 (after 'h') ends on it
    assert a.teacher_row[0] == 0


def test_different_bytes_are_refused() -> None:
    s_tok, t_tok = byte_level(), bpe(4096)
    with pytest.raises(ValueError, match="not the teacher's bytes"):
        align_tokens(
            s_tok.encode("hello"), t_tok.encode("hallo"), token_bytes(s_tok), token_bytes(t_tok)
        )
    with pytest.raises(ValueError, match=r"\[0, 258\)"):
        align_tokens([999], [1], token_bytes(s_tok), token_bytes(t_tok))
