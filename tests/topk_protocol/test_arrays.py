"""SequenceArrays: shapes checked once, rows and columns cut as views, chunks joined."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

from topk_protocol import SequenceArrays
from topk_protocol.arrays import ARRAY_FIELDS


def _arrays(s: int = 47, k: int = 5, start: int = 3, sampled: bool = True) -> SequenceArrays:
    rng = np.random.default_rng(s * 100 + k)
    ids = rng.integers(0, 1000, size=(s, k))  # int64: converted to int32
    lps = -np.sort(rng.exponential(2.0, (s, k)), axis=1)  # float64: converted to float32
    sp = -rng.exponential(2.0, s) if sampled else None
    return SequenceArrays(ids, lps, sp, start)


def test_converts_dtypes_and_describes_its_shape() -> None:
    a = _arrays()
    assert a.ids.dtype == np.int32 and a.logprobs.dtype == np.float32
    assert a.sampled_logprobs is not None and a.sampled_logprobs.dtype == np.float32
    assert (a.num_positions, a.top_k, len(a)) == (47, 5, 47)
    assert (a.position_start, a.position_end) == (3, 50)
    assert "positions=[3, 50)" in repr(a) and "top_k=5" in repr(a)
    ids = np.zeros((2, 3), np.int32)
    assert SequenceArrays(ids, np.zeros((2, 3), np.float32)).ids is ids  # no copy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ids": np.zeros(4)}, r"ids: expected \[S, K\]"),
        ({"logprobs": np.zeros((47, 4))}, r"logprobs: expected shape \[S, K\] = \(47, 5\)"),
        ({"sampled_logprobs": np.zeros(46)}, r"sampled_logprobs: expected shape \[S\] = \(47,\)"),
        ({"logprobs": None}, "logprobs: required"),
        ({"position_start": -1}, "position_start: must be >= 0"),
        ({"position_start": 1.5}, "position_start: expected an int"),
    ],
)
def test_bad_shapes_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(_arrays(), **kwargs)


def test_rows_and_positions_are_views_with_moved_start() -> None:
    a = _arrays()
    part = a.rows(10, 20)
    assert (part.position_start, part.position_end, part.top_k) == (13, 23, 5)
    assert np.shares_memory(part.ids, a.ids) and np.shares_memory(part.logprobs, a.logprobs)
    np.testing.assert_array_equal(part.ids, a.ids[10:20])
    assert part.sampled_logprobs is not None and a.sampled_logprobs is not None
    np.testing.assert_array_equal(part.sampled_logprobs, a.sampled_logprobs[10:20])
    same = a.positions(13, 23)
    np.testing.assert_array_equal(same.logprobs, part.logprobs)
    assert same.position_start == 13
    with pytest.raises(ValueError, match=r"rows: \[40, 48\) is not inside \[0, 47\)"):
        a.rows(40, 48)
    with pytest.raises(ValueError, match=r"positions: \[2, 5\) is not inside the rows' \[3, 50\)"):
        a.positions(2, 5)


def test_empty_rows_everywhere() -> None:
    a = _arrays()
    none = a.rows(5, 5)
    assert (len(none), none.top_k, none.position_start) == (0, 5, 8)
    e = SequenceArrays.empty(4, position_start=9)
    assert e.ids.shape == (0, 4) and e.logprobs.shape == (0, 4)
    assert e.sampled_logprobs is not None and e.sampled_logprobs.shape == (0,)
    assert (e.position_start, e.position_end) == (9, 9)
    for f in ARRAY_FIELDS:  # every field present (candidates only when asked), its dtype
        assert (getattr(e, f.name) is None) == f.candidates
        if not f.candidates:
            assert getattr(e, f.name).dtype == f.dtype
    ec = SequenceArrays.empty(4, position_start=9, num_candidates=3)
    for f in ARRAY_FIELDS:
        assert getattr(ec, f.name).dtype == f.dtype
    assert ec.candidate_ids is not None and ec.candidate_ids.shape == (0, 3)
    assert len(SequenceArrays.concat([a.rows(0, 0), a.rows(0, 47), a.rows(47, 47)])) == 47


def test_top_cuts_columns() -> None:
    a = _arrays()
    t = a.top(2)
    assert t.ids.shape == (47, 2) and t.logprobs.shape == (47, 2)
    np.testing.assert_array_equal(t.ids, a.ids[:, :2])
    assert t.sampled_logprobs is a.sampled_logprobs  # [S] fields are not cut
    assert a.top(5) is a
    for k in (0, 6):
        with pytest.raises(ValueError, match=rf"top_k: {k} is not in \[1, 5\]"):
            a.top(k)


def test_concat_joins_consecutive_chunks() -> None:
    a = _arrays()
    cuts = [0, 1, 20, 46, 47]
    parts = [a.rows(x, y) for x, y in pairwise(cuts)]
    whole = SequenceArrays.concat(parts)
    assert (whole.position_start, len(whole)) == (3, 47)
    for f in ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(whole, f.name), getattr(a, f.name))
    assert SequenceArrays.concat([a]) is a
    # An optional field survives only when every chunk has it.
    mixed = [parts[0], replace(parts[1], sampled_logprobs=None)]
    assert SequenceArrays.concat(mixed).sampled_logprobs is None
    with pytest.raises(ValueError, match="parts: need at least one chunk"):
        SequenceArrays.concat([])
    with pytest.raises(ValueError, match=r"parts\[1\]: starts at position 23"):
        SequenceArrays.concat([a.rows(0, 10), a.rows(20, 30)])
    with pytest.raises(ValueError, match=r"parts\[1\]: top_k 2, parts\[0\] has 5"):
        SequenceArrays.concat([a.rows(0, 10), a.rows(10, 20).top(2)])


def test_without_sampled_and_pickling() -> None:
    import pickle

    a = _arrays(sampled=False)
    assert a.sampled_logprobs is None and len(a.rows(2, 4)) == 2
    b = pickle.loads(pickle.dumps(_arrays()))
    np.testing.assert_array_equal(b.logprobs, _arrays().logprobs)
    assert b.position_start == 3


def test_a_server_only_field_is_cut_and_joined_but_never_encoded() -> None:
    """``sampled_ranks`` (``wire=False``) follows every slice, join and copy like the other
    fields, and the codec leaves it out: the decoded payload has none."""
    from topk_protocol import decode_sequence, encode_sequence
    from topk_protocol.arrays import WIRE_FIELDS

    assert "sampled_ranks" not in {f.name for f in WIRE_FIELDS}
    server_only = {f.name for f in ARRAY_FIELDS} - {f.name for f in WIRE_FIELDS}
    assert server_only == {"sampled_ranks", "row_kinds"}
    base = _arrays(s=13, k=4)
    ranks = np.arange(1, 14)  # int64: converted to int32
    a = replace(base, sampled_ranks=ranks)
    assert a.sampled_ranks is not None and a.sampled_ranks.dtype == np.int32
    assert a.nbytes == base.nbytes + 13 * 4
    for cut, want in ((a.rows(2, 9), ranks[2:9]), (a.top(2), ranks), (a.copy(), ranks)):
        np.testing.assert_array_equal(cut.sampled_ranks, want)
    joined = SequenceArrays.concat([a.rows(0, 5), a.rows(5, 13)])
    np.testing.assert_array_equal(joined.sampled_ranks, ranks)
    assert SequenceArrays.concat([a.rows(0, 5), base.rows(5, 13)]).sampled_ranks is None
    assert a.copy().sampled_ranks is not a.sampled_ranks
    decoded = decode_sequence(encode_sequence(a, dtype="float32"))
    assert decoded.sampled_ranks is None
    np.testing.assert_array_equal(decoded.ids, a.ids)
    with pytest.raises(ValueError, match=r"sampled_ranks: expected shape \[S\]"):
        replace(base, sampled_ranks=np.zeros(12))
