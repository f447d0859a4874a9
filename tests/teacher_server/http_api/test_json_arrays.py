"""The vectorized JSON writer: every finite float32 written as a JSON number of at most
9 significant digits that reads back as the same float32 (random bit patterns over
[-1e30, 1e30], subnormals, edge values, a hypothesis property), as short as numpy's
shortest in the log-prob range, laid out as Python writes a float; non-finite values
replaced; integers; lists with entries dropped, objects, joins and string tables
against plain Python references."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from teacher_server.http_api.json_arrays import (
    Cells,
    concat,
    joined,
    json_floats,
    json_ints,
    json_lists,
    padded_strings,
    table_cells,
)

#: A JSON number as the writer writes a float: Python's float ``repr`` forms.
FLOAT = re.compile(r"^-?(0|[1-9]\d*)\.\d+$|^-?[1-9](\.\d+)?e[+-]\d\d$")


def texts(values: np.ndarray, nonfinite: float = -9999.0) -> list[str]:
    """Each value's text, one by one (the writer's rows, split)."""
    body = joined(json_floats(np.asarray(values, np.float32), nonfinite)).decode()
    return body.split(",") if body else []


def significant(text: str) -> int:
    """Significant digits of a number's text (leading and trailing zeros aside)."""
    mantissa = text.lstrip("-").split("e")[0].replace(".", "")
    return max(len(mantissa.strip("0")), 1)


def check_round_trip(values: np.ndarray) -> None:
    values = np.asarray(values, np.float32)
    out = texts(values)
    assert len(out) == values.size
    back = np.array([float(t) for t in out], np.float64).astype(np.float32)
    bad = ~((back == values) & (np.signbit(back) == np.signbit(values)))
    assert not bad.any(), list(zip(values[bad][:5].tolist(), np.array(out)[bad][:5], strict=True))
    assert all(FLOAT.match(t) for t in out), [t for t in out if not FLOAT.match(t)][:5]
    assert max((significant(t) for t in out), default=0) <= 9


def finite_bit_patterns(n: int, seed: int, bound: float = 1e30) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return x[np.isfinite(x) & (np.abs(x) <= bound)]


EDGES = [
    0.0,
    -0.0,
    -1e-8,
    -1e-45,
    1e-45,
    -1.4e-45,
    -1.17549435e-38,
    -88.7,
    -103.28,
    -1e4,
    -2.0,
    -0.5,
    -0.1,
    -0.123456789,
    -12.5,
    -1.5e-7,
    -9999.0,
    -1e-4,
    -9.99999e-5,
    -1e-5,
    -0.00123,
    1e15,
    1e16,
    9.999999e15,
    16777216.0,
    16777217.0,
    3.4028235e38,
    -3.4028235e38,
    1.0,
    10.0,
    100.0,
    1234567.0,
    *(10.0**k for k in range(-45, 39)),
    *(-(10.0**k) for k in range(-45, 39)),
    *(2.0**k for k in range(-149, 128, 7)),
]


def test_every_finite_float32_reads_back_as_itself() -> None:
    """Random bit patterns (every exponent, subnormals included) within [-1e30, 1e30],
    every float32 power of ten, powers of two and edge values: each text reads back
    (decimal -> float64 -> float32) as the same value, sign of zero included."""
    check_round_trip(finite_bit_patterns(200_000, seed=47))
    check_round_trip(np.array(EDGES, np.float32))


def test_the_log_prob_range_is_as_short_as_numpy_shortest() -> None:
    """Log-probs in [-100, 0): each text is numpy's shortest round-trip decimal of the
    float32 (the same number, so as many digits)."""
    rng = np.random.default_rng(5)
    values = -np.concatenate(
        [rng.exponential(3, 20_000), 10.0 ** rng.uniform(-9, 2, 20_000)]
    ).astype(np.float32)
    for text, v in zip(texts(values), values, strict=True):
        assert float(text) == float(np.format_float_scientific(v, unique=True)), (text, v)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (-2.0, "-2.0"),
        (-0.5, "-0.5"),
        (-12.5, "-12.5"),
        (-0.123456789, "-0.12345679"),
        (-88.7, "-88.7"),
        (-103.28, "-103.28"),
        (-1e4, "-10000.0"),
        (-1e-4, "-0.0001"),
        (-1e-5, "-1e-05"),
        (-1.5e-7, "-1.5e-07"),
        (-1e-8, "-1e-08"),
        (1e-45, "1e-45"),
        (1e15, "1000000000000000.0"),
        (1e16, "1e+16"),
        (3.4028235e38, "3.4028235e+38"),
        (16777216.0, "16777216.0"),
    ],
)
def test_python_float_forms(value: float, text: str) -> None:
    """Plain decimal where the leading digit's exponent is in [-4, 15] (a digit after
    the point always), e-notation with two exponent digits otherwise, as ``repr``."""
    assert texts(np.array([value])) == [text]


def test_non_finite_values_are_the_callers_replacement() -> None:
    values = np.array([-np.inf, np.inf, np.nan, -1.5], np.float32)
    assert texts(values, nonfinite=-9999.0) == ["-9999.0"] * 3 + ["-1.5"]
    assert texts(values, nonfinite=-1e30) == ["-1e+30"] * 3 + ["-1.5"]


def test_no_values() -> None:
    assert texts(np.zeros(0)) == []
    assert json_ints(np.zeros(0, np.int32)).tobytes() == b""


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64))
def test_round_trip_property(values: list[float]) -> None:
    """Any finite float32 values: each reads back as itself, in a JSON float's form, at
    most 9 significant digits."""
    check_round_trip(np.array(values, np.float32))


def test_ints() -> None:
    values = np.array([0, 7, -1, 10, 99, 100, 151_935, -(2**31), 2**31 - 1], np.int32)
    rows = json_ints(values)
    assert json.loads(b"[" + joined(rows) + b"]") == values.tolist()
    rng = np.random.default_rng(3)
    many = rng.integers(-(2**31), 2**31, 10_000).astype(np.int32)
    assert json.loads(b"[" + joined(json_ints(many)) + b"]") == many.tolist()


def _reference_lists(items: list[str], keep: np.ndarray, brackets: str = "[]") -> list[str]:
    k = keep.shape[1]
    return [
        brackets[0] + ",".join(items[s * k + j] for j in range(k) if keep[s, j]) + brackets[1]
        for s in range(keep.shape[0])
    ]


@pytest.mark.parametrize(("s", "k"), [(0, 1), (1, 1), (3, 5), (47, 64), (5, 0)])
def test_lists_drop_entries_and_join(s: int, k: int) -> None:
    """Lists of ``[S, K]`` entries with random ones dropped (rows all dropped, rows
    all kept), as lists and as objects, joined with commas: as Python joins them."""
    rng = np.random.default_rng(s * 100 + k)
    ids = rng.integers(0, 1000, (s, k)).astype(np.int32)
    keep = rng.random((s, k)) < 0.7
    if s >= 3:
        keep[0] = False
        keep[1] = True
    items = concat(b"[", json_ints(ids.reshape(-1)), b",null]")
    want = _reference_lists([f"[{i},null]" for i in ids.reshape(-1).tolist()], keep)
    assert joined(json_lists(items, keep)) == ",".join(want).encode()
    members = concat(b'"', json_ints(ids.reshape(-1)), b'":1')
    want = _reference_lists([f'"{i}":1' for i in ids.reshape(-1).tolist()], keep, "{}")
    assert joined(json_lists(members, keep, (b"{", b"}"))) == ",".join(want).encode()


def test_string_table() -> None:
    """A table of JSON strings (multi-byte characters, escapes, an empty one), its rows
    taken per entry, as wide as the longest taken."""
    words = ["a", "", "héllo", '"q"', "\n", "日本語テキスト"]
    encoded = [json.dumps(w, ensure_ascii=False).encode() for w in words]
    chars, lengths = padded_strings(encoded)
    index = np.array([2, 0, 0, 5, 3, 1, 4])
    cells = table_cells(chars, lengths, index)
    assert joined(cells) == b",".join(encoded[i] for i in index)
    narrow = table_cells(chars, lengths, np.array([0, 1]))
    assert narrow.blocks[0].chars.shape[1] == 3 and joined(narrow) == b'"a",""'


def test_cells_where_take_and_row_counts() -> None:
    ints = json_ints(np.array([1, -22, 333]))
    assert concat(ints, b";").where(np.array([True, False, True])).tobytes() == b"1;333;"
    assert ints.take(np.array([2, 2, 0])).tobytes() == b"3333331"
    with pytest.raises(ValueError, match="one count"):
        concat(ints, json_ints(np.array([1])))
    assert isinstance(Cells.of(np.zeros((2, 0), np.uint8), np.ones(2, bool)), Cells)
