"""A student's payload rows from the teacher's rows (``alignment.rows``), against a
reference that walks bytes and tokens with Python loops: which teacher row each student
row reads, the projected top-k there, the chain-rule log-prob of the next token (not
served where a chain of several teacher tokens starts with a listed twin), and masked
rows of NaN; and that ``teacher_span`` asks for exactly the rows that are read."""

from __future__ import annotations

import math

import numpy as np
import pytest

from teacher_server.alignment import align_lengths
from teacher_server.alignment.rows import student_rows, teacher_span
from teacher_server.alignment.vocab_map import UNMAPPED, VocabMap

K, VT, VS = 4, 30, 25


def _reference_rows(
    s_len: list[int], t_len: list[int], offset: int
) -> list[tuple[int, int | None]]:
    """Per student row: (teacher row it reads or -1, last teacher row of the next token's
    chain or None), by walking cumulative byte counts."""
    ends: dict[int, int] = {}
    total = 0
    for j, n in enumerate(t_len):
        total += n
        ends[total] = j  # the last teacher row ending at that byte
    out = []
    pos = offset
    for t, n in enumerate(s_len):
        pos += n
        row = ends.get(pos, -1)
        chain = None
        if row >= 0 and t + 1 < len(s_len) and s_len[t + 1] > 0:
            chain = ends.get(pos + s_len[t + 1])
        out.append((row, chain))
    return out


def _case(seed: int) -> tuple[list[int], list[int], int]:
    """Byte lengths of two tokenizations of the same bytes (teacher with a zero-byte BOS
    at times, the student offset by a prepended space at times)."""
    rng = np.random.default_rng(seed)
    total = int(rng.integers(5, 40))
    cuts_s = sorted(set(rng.integers(1, total, int(rng.integers(1, total))).tolist()))
    cuts_t = sorted(set(rng.integers(1, total, int(rng.integers(1, total))).tolist()))
    s_len = np.diff([0, *cuts_s, total]).tolist()
    t_len = np.diff([0, *cuts_t, total]).tolist()
    offset = int(seed % 3 == 0)
    if offset:
        t_len = [t_len[0] + 1, *t_len[1:]] if seed % 2 else [1, *t_len]
    if seed % 4 == 1:
        t_len = [0, *t_len]  # a BOS
    return s_len, t_len, offset


@pytest.mark.parametrize("seed", range(24))
def test_rows_against_a_byte_walk(seed: int) -> None:
    s_len, t_len, offset = _case(seed)
    alignment = align_lengths(s_len, t_len, student_offset=offset)
    rng = np.random.default_rng(100 + seed)
    lt, ls = len(t_len), len(s_len)
    t_ids = np.stack([rng.permutation(VT)[:K] for _ in range(lt)])
    t_lps = -np.sort(rng.exponential(1.0, (lt, K)), axis=1).astype(np.float32)
    t_sampled = np.log(rng.uniform(0.05, 1.0, lt))
    t_sampled[-1] = np.nan
    table = rng.permutation(VS + VT)[:VT].astype(np.int32)
    table[table >= VS] = UNMAPPED  # some teacher ids have no student twin
    vmap = VocabMap(table, VS)
    t_tokens = rng.integers(0, VT, lt)
    if seed % 2:  # each chain's first token: the top teacher id of the row before
        t_tokens[1:] = t_ids[:-1, 0]
    want = _reference_rows(s_len, t_len, offset)
    for start, end in ((0, ls), (ls // 3, ls - ls // 4), (ls - 1, ls)):
        ts, te = teacher_span(alignment, start, end)
        got = student_rows(
            alignment,
            start,
            end,
            (t_ids[ts:te], t_lps[ts:te], t_sampled[ts:te]),
            ts,
            vmap,
            t_tokens,
        )
        assert got.ids.shape == got.logprobs.shape == (end - start, K)
        for r, t in enumerate(range(start, end)):
            row, chain = want[t]
            if row < 0:  # masked: every log-prob NaN, ids 0..K-1, no actual token
                assert got.kinds[r] == 0 and np.isnan(got.logprobs[r]).all()
                assert got.ids[r].tolist() == list(range(K))
                assert math.isnan(got.sampled_logprobs[r])
                continue
            pairs = zip(t_ids[row], t_lps[row], strict=True)
            mapped = [(int(table[i]), float(v)) for i, v in pairs if table[i] != UNMAPPED]
            n = len(mapped)
            assert got.ids[r, :n].tolist() == [i for i, _ in mapped]
            np.testing.assert_array_equal(got.logprobs[r, :n], [v for _, v in mapped])
            assert np.isneginf(got.logprobs[r, n:]).all()  # padding columns
            assert len(set(got.ids[r].tolist())) == K
            twin = table[t_tokens[row + 1]] if chain is not None else UNMAPPED
            if chain is not None and chain - row >= 2 and twin in [i for i, _ in mapped]:
                chain = None  # its event lies inside a listed entry's: not served
            if chain is None:
                assert got.kinds[r] == 1 and math.isnan(got.sampled_logprobs[r])
            else:
                assert got.kinds[r] == 2
                total = sum(float(t_sampled[i]) for i in range(row, chain))
                assert got.sampled_logprobs[r] == pytest.approx(total, rel=1e-6)
        # the span is exactly the rows read: one fewer at either end is refused
        for a, b in ((ts + 1, te), (ts, te - 1)) if ts < te else ():
            short = (t_ids[a:b], t_lps[a:b], t_sampled[a:b])
            with pytest.raises(ValueError, match="do not hold the rows"):
                student_rows(alignment, start, end, short, a, vmap, t_tokens)


def test_every_row_masked_needs_no_teacher_row() -> None:
    """Student rows that all end inside one teacher token: nothing to ask the engine."""
    alignment = align_lengths([1, 1, 1, 1], [5])  # bytes 1..4 end inside the one token
    assert teacher_span(alignment, 0, 3) == (0, 0)
    empty = (np.zeros((0, K), np.int32), np.zeros((0, K), np.float32), np.zeros(0))
    vmap = VocabMap(np.arange(VT, dtype=np.int32), VT)
    got = student_rows(alignment, 0, 3, empty, 0, vmap, np.array([7]))
    assert got.kinds.tolist() == [0, 0, 0] and np.isnan(got.logprobs).all()


def test_candidates_by_the_teacher_rows_that_read_them() -> None:
    """The module doc's example: student rows 0, 1, 4 read teacher rows 0, 3, 4; rows 2,
    3 are masked. Candidates travel to those teacher rows in teacher ids; a candidate
    with no single teacher token is refused naming it."""
    from teacher_server.alignment.rows import teacher_candidates

    alignment = align_lengths([1, 3, 1, 1, 1], [1, 1, 1, 1, 3])
    to_teacher = np.array([10, 11, -1, 13, 14])  # student id 2: no single teacher token
    cand = np.array([[0, -1], [1, 3], [4, 4], [0, 0], [3, -1]])
    out, index = teacher_candidates(alignment, 0, 5, cand, to_teacher)
    assert index.tolist() == [0, 3, -1, -1, 4]
    assert out.tolist() == [[10, -1], [-1, -1], [-1, -1], [11, 13], [13, -1]]
    out, index = teacher_candidates(alignment, 1, 3, cand[1:3], to_teacher)  # rows 3..3
    assert index.tolist() == [0, -1] and out.tolist() == [[11, 13]]
    with pytest.raises(ValueError, match=r"^\[1\]\[0\]: student id 2 is not one teacher token"):
        teacher_candidates(alignment, 0, 5, np.array([[0], [2], [0], [0], [0]]), to_teacher)
