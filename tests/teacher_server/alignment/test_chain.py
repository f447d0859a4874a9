"""Chain-rule log-probs of aligned student tokens, against float64 sums taken one teacher
row at a time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from teacher_server.alignment.boundaries import align_lengths, align_tokens
from teacher_server.alignment.chain import chain_logprobs
from teacher_server.alignment.token_bytes import token_bytes
from tests.teacher_server.alignment.tokenizer_cases import TEXTS, bpe, byte_level


def reference(
    student_lengths: list[int], teacher_lengths: list[int], sampled: list[float], offset: int = 0
) -> list[float]:
    """Per student row: the sum of the teacher's actual-token log-probs over the teacher
    tokens that spell the next student token, when that token starts and ends on teacher
    token ends (with bytes); NaN otherwise. Loops over bytes and tokens, no numpy."""
    ends: dict[int, int] = {}  # teacher prefix bytes -> last teacher row with that prefix
    total = 0
    for j, n in enumerate(teacher_lengths):
        total += n
        ends[total] = j
    out = []
    start = offset
    for t in range(len(student_lengths)):
        start += student_lengths[t]
        value = math.nan
        if t + 1 < len(student_lengths) and student_lengths[t + 1] > 0:
            stop = start + student_lengths[t + 1]
            if start in ends and stop in ends:
                acc = 0.0
                for i in range(ends[start], ends[stop]):
                    acc += sampled[i]
                value = acc
        out.append(value)
    return out


def check(
    student: list[int], teacher: list[int], sampled: list[float], offset: int = 0
) -> np.ndarray:
    got = chain_logprobs(align_lengths(student, teacher, student_offset=offset), sampled)
    want = np.array(reference(student, teacher, sampled, offset), dtype=np.float64)
    assert got.dtype == np.float64 and got.shape == (len(student),)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)  # NaN where NaN
    return got


def test_a_student_token_spanning_three_teacher_tokens() -> None:
    # student a | bcd | e | f | g, teacher a | b | c | d | efg (the boundaries doc)
    sampled = [-0.5, -0.25, -0.125, -1.0, math.nan]
    got = check([1, 3, 1, 1, 1], [1, 1, 1, 1, 3], sampled)
    assert got[0] == -0.875  # log p(b | a) + log p(c | ab) + log p(d | abc)
    assert np.isnan(got[1:]).all()


def test_identity_is_the_teacher_sampled_logprobs() -> None:
    sampled = np.array([-0.1, -2.5, -0.3, -7.0, np.nan])
    got = check([2, 1, 3, 1, 1], [2, 1, 3, 1, 1], sampled.tolist())
    assert got[:-1].tolist() == sampled[:-1].tolist()  # bit for bit: one-term sums
    assert np.isnan(got[-1])


def test_teacher_bos_and_offsets() -> None:
    # zero-byte BOS on both sides: row 0 (after BOS) predicts the first text token
    check([0, 2, 1], [0, 1, 1, 1], [-1.0, -2.0, -3.0, math.nan])
    got = chain_logprobs(align_lengths([0, 2, 1], [0, 1, 1, 1]), [-1.0, -2.0, -3.0, math.nan])
    assert got.tolist()[:2] == [-3.0, -3.0]
    # the student starts one byte into the teacher's first token
    check([1, 1, 2], [3, 2], [-0.5, math.nan], offset=1)


def test_no_aligned_row_is_all_nan() -> None:
    got = chain_logprobs(align_lengths([1, 1, 1], [3]), [math.nan])
    assert got.shape == (3,) and np.isnan(got).all()
    assert chain_logprobs(align_lengths([], [1]), [0.0]).shape == (0,)


def test_the_teacher_shape_is_checked() -> None:
    a = align_lengths([1, 1], [1, 1])
    with pytest.raises(ValueError, match=r"\[Lt\] = \(2,\)"):
        chain_logprobs(a, [0.0])


@settings(max_examples=examples(300))
@given(
    student=st.lists(st.integers(0, 4), max_size=12),
    teacher=st.lists(st.integers(0, 4), max_size=12),
    offset=st.integers(0, 2),
    data=st.data(),
)
def test_any_lengths_match_the_reference(
    student: list[int], teacher: list[int], offset: int, data: st.DataObject
) -> None:
    sampled = data.draw(
        st.lists(
            st.floats(-30.0, 0.0, allow_nan=False), min_size=len(teacher), max_size=len(teacher)
        )
    )
    if sampled:
        sampled[-1] = math.nan  # the teacher's last row has no next token
    check(student, teacher, sampled, offset)


@st.composite
def same_bytes(draw: st.DrawFn) -> tuple[list[int], list[int], list[float]]:
    """Two segmentations of the same bytes (most rows aligned) and teacher log-probs."""
    n = draw(st.integers(1, 30))
    out = []
    for _ in range(2):
        cuts = sorted(draw(st.sets(st.integers(1, n), max_size=n)) | {n})
        out.append([b - a for a, b in zip([0, *cuts], cuts, strict=False)])
    sampled = draw(st.lists(st.floats(-20.0, 0.0), min_size=len(out[1]), max_size=len(out[1])))
    return out[0], out[1], sampled


@settings(max_examples=examples(300))
@given(case=same_bytes())
def test_same_bytes_match_the_reference(case: tuple[list[int], list[int], list[float]]) -> None:
    student, teacher, sampled = case
    check(student, teacher, sampled)


def test_long_sequences_keep_float64_precision() -> None:
    """100k teacher rows, student tokens of 1..3 teacher tokens: each chain is its own
    float64 sum (no difference of large prefix sums)."""
    rng = np.random.default_rng(0)
    teacher = [1] * 100_000
    ends = np.cumsum(rng.integers(1, 4, size=60_000))
    student = np.diff(np.append(ends[ends < 100_000], 100_000), prepend=0).tolist()
    assert sum(student) == 100_000 and max(student) <= 3
    sampled = (-rng.exponential(3.0, size=100_000)).tolist()
    got = chain_logprobs(align_lengths(student, teacher), sampled)
    want = np.array(reference(student, teacher, sampled))
    assert np.isnan(got[-1]) and not np.isnan(got[:-1]).any()
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_real_tokenizers(text: str) -> None:
    """The byte student against a BPE teacher: the aligned rows' chains are the sums of
    (made-up) teacher log-probs over the teacher tokens each student token spans; with
    the byte student every teacher token ending a student token is one byte long."""
    s_tok, t_tok = bpe(1000), bpe(4096)
    s_table, t_table = token_bytes(s_tok), token_bytes(t_tok)
    s_ids, t_ids = s_tok.encode(text), t_tok.encode(text)
    sampled = np.linspace(-3.0, -0.01, len(t_ids))
    sampled[-1] = np.nan
    a = align_tokens(s_ids, t_ids, s_table, t_table)
    got = chain_logprobs(a, sampled)
    want = reference(
        s_table.lengths[s_ids].tolist(), t_table.lengths[t_ids].tolist(), sampled.tolist()
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.isnan(got[~a.aligned]).all() and not np.isnan(got[a.aligned]).any()


def test_byte_student_chains_are_single_byte_teacher_tokens() -> None:
    s_tok, t_tok = byte_level(), bpe(4096)
    text = "héllo wörld"
    s_ids, t_ids = s_tok.encode(text), t_tok.encode(text)
    t_table = token_bytes(t_tok)
    a = align_tokens(s_ids, t_ids, token_bytes(s_tok), t_table)
    sampled = -np.arange(1, len(t_ids) + 1, dtype=np.float64)
    got = chain_logprobs(a, sampled)
    for t in np.flatnonzero(a.aligned):
        j = a.teacher_row[t]
        assert t_table.lengths[t_ids[j + 1]] == 1  # the next byte is one teacher token
        assert got[t] == sampled[j]
