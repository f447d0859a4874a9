"""Teacher ids to student ids by identical bytes, and the projection of top-k rows,
against references written one id and one row at a time."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from teacher_server.alignment.token_bytes import TokenBytes, token_bytes
from teacher_server.alignment.vocab_map import (
    UNMAPPED,
    VocabMap,
    build_vocab_map,
    project_topk,
)
from tests.teacher_server.alignment.tokenizer_cases import (
    bpe,
    byte_level,
    sentencepiece,
    sentencepiece_legacy,
)

TOKENIZERS: dict[str, Callable[[], Any]] = {
    "byte": byte_level,
    "bpe4096": lambda: bpe(4096),
    "bpe1000": lambda: bpe(1000),
    "spm": lambda: sentencepiece("never"),
    "spm_legacy": sentencepiece_legacy,
}


def reference_map(teacher: TokenBytes, student: TokenBytes) -> list[int]:
    """Per teacher id: the student id of the same non-empty bytes and the same special
    flag, preferring a non-fallback piece, then the lowest id; -1 if none, or if an
    earlier-preferred teacher id already has those bytes."""

    def preferred(table: TokenBytes) -> dict[tuple[bool, bytes], int]:
        best: dict[tuple[bool, bytes], int] = {}
        for i in range(table.vocab_size):
            piece = table.pieces[i]
            if not piece:
                continue
            key = (bool(table.special[i]), piece)
            old = best.get(key)
            if old is None or (table.fallback[old], old) > (table.fallback[i], i):
                best[key] = i
        return best

    student_best = preferred(student)
    teacher_best = preferred(teacher)
    out = [-1] * teacher.vocab_size
    for key, t in teacher_best.items():
        out[t] = student_best.get(key, -1)
    return out


def _assert_injective(vocab_map: VocabMap) -> None:
    mapped = vocab_map.teacher_to_student[vocab_map.teacher_to_student != UNMAPPED]
    assert len(np.unique(mapped)) == len(mapped)
    assert mapped.size == 0 or int(mapped.max()) < vocab_map.student_vocab_size


@pytest.mark.parametrize("teacher", sorted(TOKENIZERS))
@pytest.mark.parametrize("student", sorted(TOKENIZERS))
def test_map_matches_the_reference(teacher: str, student: str) -> None:
    t_table = token_bytes(TOKENIZERS[teacher]())
    s_table = token_bytes(TOKENIZERS[student]())
    vocab_map = build_vocab_map(t_table, s_table)
    assert vocab_map.teacher_to_student.dtype == np.int32
    assert vocab_map.teacher_to_student.shape == (t_table.vocab_size,)
    assert vocab_map.student_vocab_size == s_table.vocab_size
    assert vocab_map.teacher_to_student.tolist() == reference_map(t_table, s_table)
    _assert_injective(vocab_map)
    mapped = np.flatnonzero(vocab_map.teacher_to_student >= 0)
    s_ids = vocab_map.teacher_to_student[mapped]
    assert s_table.pieces[s_ids].tolist() == t_table.pieces[mapped].tolist()
    assert (s_table.special[s_ids] == t_table.special[mapped]).all()


@pytest.mark.parametrize("name", ["byte", "bpe4096", "bpe1000"])
def test_the_same_tokenizer_maps_to_itself(name: str) -> None:
    table = token_bytes(TOKENIZERS[name](), vocab_size=len(TOKENIZERS[name]()) + 5)
    vocab_map = build_vocab_map(table, table)
    defined = table.vocab_size - 5
    assert vocab_map.teacher_to_student[:defined].tolist() == list(range(defined))
    assert vocab_map.teacher_to_student[defined:].tolist() == [UNMAPPED] * 5  # no bytes


def test_sentencepiece_to_itself_keeps_one_id_per_byte_string() -> None:
    """``<0x41>`` and ``A`` are both ``b'A'``: the piece maps to itself, the fallback byte
    to nothing (its mass goes to the tail); a fallback byte no piece repeats maps to
    itself."""
    tok = sentencepiece()
    table = token_bytes(tok)
    vocab = tok.get_vocab()
    got = build_vocab_map(table, table).teacher_to_student
    assert got[vocab["A"]] == vocab["A"]
    assert got[vocab["<0x41>"]] == UNMAPPED
    assert got[vocab["<0x5A>"]] == vocab["<0x5A>"]  # no piece "Z"
    assert got[vocab["▁"]] == vocab["▁"]
    assert got[vocab["<0x20>"]] == UNMAPPED  # " " is the piece "▁"
    unmapped = np.flatnonzero(got == UNMAPPED)
    assert table.fallback[unmapped].all()


def test_byte_student_and_bpe_teacher() -> None:
    t_table, s_table = token_bytes(bpe(4096)), token_bytes(byte_level())
    got = build_vocab_map(t_table, s_table).teacher_to_student
    assert got[:258].tolist() == list(range(258))  # bytes and specials
    assert (got[258:] == UNMAPPED).all()  # every merged token spans 2+ bytes
    # and the other way: only single bytes and specials have a teacher id
    back = build_vocab_map(s_table, t_table).teacher_to_student
    assert back.tolist() == list(range(258))


def test_byte_student_and_sentencepiece_teacher() -> None:
    tok = sentencepiece()
    vocab = tok.get_vocab()
    got = build_vocab_map(token_bytes(tok), token_bytes(byte_level())).teacher_to_student
    assert got[vocab["A"]] == ord("A")
    assert got[vocab["<0x41>"]] == UNMAPPED
    assert got[vocab["<0xE6>"]] == 0xE6  # a fallback byte is a byte
    assert got[vocab["▁"]] == ord(" ")
    assert got[vocab["▁h"]] == UNMAPPED  # two bytes
    assert got[vocab["<s>"]] == UNMAPPED  # the byte student has no <s>


def test_specials_map_only_to_specials_of_the_same_content() -> None:
    """The teacher's special ``<s>`` does not map to the student's text ``<s>``; its
    special ``</s>`` maps to the student's special ``</s>``; the teacher's text
    ``<think>`` maps to the student's text ``<think>``, never to a special."""
    student = copy.deepcopy(byte_level())
    student.add_tokens(["<s>", "<think>"])  # text
    student.add_special_tokens({"additional_special_tokens": ["</s>"]})
    teacher = sentencepiece()  # <s>, </s> special; <think> text
    s_table, t_table = token_bytes(student), token_bytes(teacher)
    got = build_vocab_map(t_table, s_table).teacher_to_student
    t_vocab, s_vocab = teacher.get_vocab(), student.get_vocab()
    assert got[t_vocab["<s>"]] == UNMAPPED
    assert got[t_vocab["</s>"]] == s_vocab["</s>"]
    assert got[t_vocab["<think>"]] == s_vocab["<think>"]
    assert got[t_vocab["<unk>"]] == UNMAPPED
    assert got.tolist() == reference_map(t_table, s_table)


# -- projection ---------------------------------------------------------------------------


def reference_projection(
    ids: list[list[int]], logprobs: list[list[float]], table: list[int], student_vocab: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Row by row: the mapped entries, stably sorted by log-prob descending; then the
    smallest student ids not in the row, at log-prob -inf, up to the row's width."""
    out_ids, out_lps = [], []
    for row_ids, row_lps in zip(ids, logprobs, strict=True):
        kept = [(table[i], lp) for i, lp in zip(row_ids, row_lps, strict=True) if table[i] >= 0]
        kept.sort(key=lambda e: -e[1])
        used = {s for s, _ in kept}
        free = (s for s in range(student_vocab) if s not in used)
        while len(kept) < len(row_ids):
            kept.append((next(free), -math.inf))
        out_ids.append([s for s, _ in kept])
        out_lps.append([lp for _, lp in kept])
    return out_ids, out_lps


@st.composite
def projection_cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, VocabMap]:
    teacher_vocab = draw(st.integers(1, 40))
    student_vocab = draw(st.integers(1, 40))
    top_k = draw(st.integers(0, min(teacher_vocab, student_vocab, 8)))
    rows = draw(st.integers(0, 5))
    # an injective partial map: a random subset of teacher ids onto distinct student ids
    targets = draw(st.permutations(range(student_vocab)))
    table = np.full(teacher_vocab, UNMAPPED, dtype=np.int32)
    for t, s in zip(draw(st.permutations(range(teacher_vocab))), targets, strict=False):
        if draw(st.booleans()):
            table[t] = s
    ids, lps = [], []
    values = st.one_of(st.floats(-20.0, 0.0), st.just(-math.inf), st.sampled_from([-1.0, -2.0]))
    for _ in range(rows):
        ids.append(draw(st.permutations(range(teacher_vocab)))[:top_k])
        lps.append(sorted((draw(values) for _ in range(top_k)), reverse=True))
    return (
        np.array(ids, dtype=np.int64).reshape(rows, top_k),
        np.array(lps, dtype=np.float32).reshape(rows, top_k),
        VocabMap(table, student_vocab),
    )


@settings(max_examples=examples(300))
@given(case=projection_cases())
def test_projection_matches_the_reference(case: tuple[np.ndarray, np.ndarray, VocabMap]) -> None:
    ids, lps, vocab_map = case
    got_ids, got_lps = project_topk(ids, lps, vocab_map)
    want_ids, want_lps = reference_projection(
        ids.tolist(),
        lps.tolist(),
        vocab_map.teacher_to_student.tolist(),
        vocab_map.student_vocab_size,
    )
    assert got_ids.dtype == np.int32 and got_lps.dtype == np.float32
    assert got_ids.shape == ids.shape and got_lps.shape == ids.shape
    assert got_ids.tolist() == want_ids
    assert got_lps.tolist() == want_lps
    for row_ids, row_lps in zip(got_ids, got_lps, strict=True):
        assert len(set(row_ids.tolist())) == len(row_ids)  # distinct, as the losses need
        assert ((row_ids >= 0) & (row_ids < vocab_map.student_vocab_size)).all()
        assert row_lps.tolist() == sorted(row_lps.tolist(), reverse=True)
    # the kept mass never exceeds the teacher's top-k mass: the rest is tail
    with np.errstate(divide="ignore"):
        assert (np.exp(got_lps).sum(-1) <= np.exp(lps).sum(-1) + 1e-6).all()


def test_identity_projection() -> None:
    table = token_bytes(bpe(1000))
    vocab_map = build_vocab_map(table, table)
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(1000)[:16] for _ in range(7)])
    lps = np.sort(np.log(rng.dirichlet(np.ones(16), size=7)), axis=-1)[:, ::-1].astype(np.float32)
    got_ids, got_lps = project_topk(ids, lps, vocab_map)
    assert got_ids.tolist() == ids.tolist()
    assert got_lps.tolist() == lps.tolist()


def test_a_byte_student_keeps_the_single_bytes() -> None:
    t_table, s_table = token_bytes(bpe(4096)), token_bytes(byte_level())
    vocab_map = build_vocab_map(t_table, s_table)
    merged = [i for i in range(258, 4096)][:3]
    ids = np.array([[merged[0], ord("a"), merged[1], 256, merged[2]]])
    lps = np.array([[-0.1, -1.0, -2.0, -3.0, -4.0]], dtype=np.float32)
    got_ids, got_lps = project_topk(ids, lps, vocab_map)
    assert got_ids.tolist() == [[ord("a"), 256, 0, 1, 2]]
    assert got_lps.tolist() == [[-1.0, -3.0, -math.inf, -math.inf, -math.inf]]


def test_an_all_unmapped_row_is_all_tail() -> None:
    vocab_map = VocabMap(np.full(10, UNMAPPED, dtype=np.int32), 4)
    got_ids, got_lps = project_topk([[3, 1, 2]], [[-0.1, -1.0, -2.0]], vocab_map)
    assert got_ids.tolist() == [[0, 1, 2]]
    assert np.isneginf(got_lps).all()


def test_padding_skips_the_ids_in_the_row() -> None:
    vocab_map = VocabMap(np.array([0, 1, UNMAPPED, 3], dtype=np.int32), 5)
    got_ids, got_lps = project_topk([[3, 2, 0]], [[-0.5, -1.0, -1.5]], vocab_map)
    assert got_ids.tolist() == [[3, 0, 1]]  # 3 and 0 kept, pad with the smallest free id
    assert got_lps.tolist() == [[-0.5, -1.5, -math.inf]]


def test_dtypes_and_empty_rows() -> None:
    vocab_map = VocabMap(np.arange(4, dtype=np.int32), 4)
    ids, lps = project_topk(np.zeros((0, 2), dtype=np.int64), np.zeros((0, 2)), vocab_map)
    assert ids.shape == (0, 2) and ids.dtype == np.int32 and lps.dtype == np.float64
    _, half = project_topk([[1, 2]], np.array([[-0.5, -1.0]], dtype=np.float16), vocab_map)
    assert half.dtype == np.float16


def test_invalid_projections_are_refused() -> None:
    vocab_map = VocabMap(np.arange(4, dtype=np.int32), 3)
    with pytest.raises(ValueError, match=r"\[S, K\]"):
        project_topk([1, 2], [0.0, 0.0], vocab_map)
    with pytest.raises(ValueError, match=r"\[S, K\]"):
        project_topk([[1, 2]], [[0.0]], vocab_map)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        project_topk([[4]], [[0.0]], vocab_map)
    with pytest.raises(ValueError, match="exceed the student's 3 ids"):
        project_topk([[0, 1, 2, 3]], [[0.0] * 4], vocab_map)
    with pytest.raises(ValueError, match="integers"):
        project_topk([[0.5]], [[0.0]], vocab_map)


def test_rows_come_out_sorted_whatever_the_input_order() -> None:
    vocab_map = VocabMap(np.array([2, UNMAPPED, 0, 1], dtype=np.int32), 4)
    got_ids, got_lps = project_topk([[0, 1, 2, 3]], [[-3.0, -0.1, -1.0, -2.0]], vocab_map)
    assert got_ids.tolist() == [[0, 1, 2, 3]]
    assert got_lps.tolist() == [[-1.0, -2.0, -3.0, -math.inf]]
