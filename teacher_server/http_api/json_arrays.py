"""JSON text of numeric arrays, built with numpy: no Python object per number.

An answer is assembled from :class:`Cells`: rows of text (one per value, per entry),
each a run of blocks side by side, a block a ``uint8`` matrix of characters ``[n, w]``
with the characters it keeps (a mask ``[n, w]``, or ``[n]`` for the whole block of a
row). Blocks are placed side by side (:func:`concat`) and rows dropped by their masks
(:meth:`Cells.where`) without copying characters; the text is read out once, row after
row, by one concatenation and one ``np.compress`` (:meth:`Cells.tobytes`). Each step
is a numpy call over whole arrays, which leaves the interpreter's lock to other threads
(the probes' event loop) for most of a render.

- :func:`json_floats`: float32 values as JSON numbers, each the shortest decimal of at
  most 9 significant digits that reads back (decimal -> float64 -> float32, or
  decimal -> float32) as the same float32; written as Python writes a float (``-12.5``,
  ``-0.125``, ``-2.0``; ``-1.5e-07`` and ``1e+16`` where the exponent is below -4 or
  above 15); a non-finite value as the caller's replacement.
- :func:`json_ints`: integers as JSON numbers.
- :func:`padded_strings` / :func:`table_cells`: pre-encoded JSON strings as a padded
  table, and its rows taken for each entry.
- :func:`json_lists`: ``[S * K]`` entries as ``S`` JSON lists (or objects) of the kept
  ones; :func:`joined`: the text of values (lists included), comma-separated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "Cells",
    "concat",
    "joined",
    "json_floats",
    "json_ints",
    "json_lists",
    "padded_strings",
    "table_cells",
]

_ZERO = ord("0")
#: Powers of ten 10^-_POW_MAX .. 10^_POW_MAX, each the float64 nearest (index k +
#: _POW_MAX: 10^k); the digit candidates' exponents reach 10^-54 (a subnormal's 10th
#: digit) and 10^38.
_POW_MAX = 60
_POW10 = np.array([float(f"1e{k}") for k in range(-_POW_MAX, _POW_MAX + 1)])
_INT_POW10 = 10 ** np.arange(19, dtype=np.int64)
#: A candidate decimal is kept only this far (relative) inside the float32's rounding
#: interval: far above float64's error in computing it (a few 2^-53), far below the
#: slack of 9 digits (at least 2^-25 - 10^-8 / 2), so every value has a candidate.
_MARGIN = 2.0**-40
#: Plain decimal for leading-digit exponents in [_PLAIN_LOW, _PLAIN_HIGH] (Python's rule).
_PLAIN_LOW, _PLAIN_HIGH = -4, 15


@dataclass(frozen=True)
class _Block:
    """``chars`` ``[n, w]`` (may be a broadcast view) and ``keep``: ``[n, w]``, or
    ``[n]`` (each row's whole block kept or not)."""

    chars: npt.NDArray[np.uint8]
    keep: npt.NDArray[np.bool_]

    def full_keep(self) -> npt.NDArray[np.bool_]:
        """``keep`` as ``[n, w]`` (a broadcast view of a row mask)."""
        if self.keep.ndim == 2:
            return self.keep
        return np.broadcast_to(self.keep[:, None], self.chars.shape)


@dataclass(frozen=True)
class Cells:
    """Rows of JSON text: ``rows`` rows, each the kept characters of its blocks, left to
    right; ``group``: how many consecutive rows write one JSON value (a list's entries:
    :func:`json_lists`; 1 otherwise)."""

    rows: int
    blocks: tuple[_Block, ...]
    group: int = 1

    @staticmethod
    def of(chars: npt.NDArray[np.uint8], keep: npt.NDArray[np.bool_]) -> Cells:
        """One block: characters ``[n, w]``, kept where ``keep`` (``[n, w]`` or ``[n]``)."""
        return Cells(int(chars.shape[0]), (_Block(chars, keep),))

    def tobytes(self) -> bytes:
        """The kept characters of every row, row after row."""
        if not self.blocks:
            return b""
        chars = np.concatenate([b.chars for b in self.blocks], axis=1)
        keep = np.concatenate([b.full_keep() for b in self.blocks], axis=1)
        return np.compress(keep.reshape(-1), chars.reshape(-1)).tobytes()

    def where(self, rows: npt.NDArray[np.bool_]) -> Cells:
        """Only the rows where ``rows`` ``[n]`` is true keep their text."""
        blocks = tuple(
            _Block(b.chars, b.keep & (rows if b.keep.ndim == 1 else rows[:, None]))
            for b in self.blocks
        )
        return Cells(self.rows, blocks, self.group)

    def take(self, index: npt.NDArray[np.integer]) -> Cells:
        """Rows ``index`` ``[m]`` of these (a table's rows for each entry)."""
        blocks = tuple(_Block(b.chars[index], b.keep[index]) for b in self.blocks)
        return Cells(int(index.size), blocks)


def _literal(text: bytes, n: int, keep: npt.NDArray[np.bool_] | None = None) -> Cells:
    """``text`` in each of ``n`` rows (where ``keep`` ``[n]``, if given)."""
    row = np.frombuffer(text, dtype=np.uint8)
    kept = np.ones(n, dtype=np.bool_) if keep is None else keep
    return Cells.of(np.broadcast_to(row, (n, row.size)), kept)


def concat(*pieces: Cells | bytes) -> Cells:
    """The pieces side by side, row by row (a ``bytes`` piece: the same text in every
    row); every :class:`Cells` piece has the same rows. No copy."""
    rows = {p.rows for p in pieces if isinstance(p, Cells)}
    if len(rows) != 1:
        raise ValueError(f"concat: pieces of {sorted(rows)} rows; expected one count")
    (n,) = rows
    blocks: list[_Block] = []
    for p in pieces:
        blocks += (_literal(p, n) if isinstance(p, bytes) else p).blocks
    return Cells(n, tuple(blocks))


def json_lists(
    items: Cells, keep: npt.NDArray[np.bool_], brackets: tuple[bytes, bytes] = (b"[", b"]")
) -> Cells:
    """``items`` ``[S * K]`` (row ``s * K + k``: entry ``k`` of list ``s``) as ``S``
    values, each ``[item,item,...]`` of the entries where ``keep`` ``[S, K]`` is true
    (``[]`` when none); ``brackets``: the list's opening and closing text (``{``, ``}``
    for an object whose items are its members). The rows stay the entries' (``group``
    K: list ``s`` is rows ``s * K .. s * K + K - 1``)."""
    s, k = keep.shape
    if k == 0:
        return Cells(s, _literal(brackets[0] + brackets[1], s).blocks)
    column = np.broadcast_to(np.arange(k), (s, k)).reshape(-1)
    # A comma before each kept entry that follows a kept one in its list.
    comma = (keep & (np.cumsum(keep, axis=1) > 1)).reshape(-1)
    entries = concat(
        _literal(brackets[0], s * k, column == 0),
        _literal(b",", s * k, comma),
        items.where(keep.reshape(-1)),
        _literal(brackets[1], s * k, column == k - 1),
    )
    return Cells(entries.rows, entries.blocks, k)


def joined(values: Cells) -> bytes:
    """The text of ``values`` (each ``values.group`` rows), separated by commas."""
    n = values.rows
    if n == 0:
        return b""
    r = np.arange(n)
    ends = ((r + 1) % values.group == 0) & (r < n - 1)
    return concat(values, _literal(b",", n, ends)).tobytes()


def padded_strings(
    encoded: Sequence[bytes],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """``encoded`` (JSON texts, e.g. ``b'"text"'``) as a table: characters ``[n, w]``
    padded to the longest, and each one's length ``[n]``."""
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    width = int(lengths.max()) if len(encoded) else 0
    chars = np.zeros((len(encoded), width), dtype=np.uint8)
    chars[np.arange(width)[None, :] < lengths[:, None]] = np.frombuffer(
        b"".join(encoded), dtype=np.uint8
    )
    return chars, lengths


def table_cells(
    chars: npt.NDArray[np.uint8], lengths: npt.NDArray[np.int64], index: npt.NDArray[np.integer]
) -> Cells:
    """Rows ``index`` ``[m]`` of a table (:func:`padded_strings`), as wide as the
    longest of them."""
    taken = lengths[index]
    width = int(taken.max()) if index.size else 0
    return Cells.of(chars[:, :width][index], np.arange(width)[None, :] < taken[:, None])


def _quads() -> npt.NDArray[np.uint32]:
    """The four characters of each of 0000 .. 9999, as one uint32 (native order)."""
    n = np.arange(10_000)
    chars = np.stack([n // 1000, n // 100 % 10, n // 10 % 10, n % 10], axis=1) + _ZERO
    return np.ascontiguousarray(chars.astype(np.uint8)).view(np.uint32).reshape(-1)


_QUADS = _quads()


def _digits(values: npt.NDArray[np.int64], width: int) -> npt.NDArray[np.uint8]:
    """``[n, width]``: the last ``width`` decimal digits of ``values`` (>= 0), as
    characters, most significant first (four at a time, from a table)."""
    chunks = -(-width // 4)
    out = np.empty((values.size, chunks), dtype=np.uint32)
    rest = values
    for col in range(chunks - 1, -1, -1):
        high = rest // 10_000
        out[:, col] = _QUADS[rest - high * 10_000]
        rest = high
    chars: npt.NDArray[np.uint8] = out.view(np.uint8).reshape(values.size, chunks * 4)
    return chars[:, chunks * 4 - width :]


def _digit_count(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Decimal digits of each of ``values`` (>= 0; 0 has one)."""
    count = np.ones(values.shape, dtype=np.int64)
    largest = int(values.max()) if values.size else 0
    for power in _INT_POW10[1:]:
        if power > largest:
            break
        count += values >= power
    return count


def json_ints(values: npt.NDArray[np.integer]) -> Cells:
    """``values`` ``[n]`` (int32 or any integer type within int64) as JSON integers."""
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    neg = v < 0
    mag = np.abs(v)
    count = _digit_count(mag)
    width = int(count.max()) if v.size else 1
    keep = np.arange(width)[None, :] >= (width - count)[:, None]
    digits = Cells.of(_digits(mag, width), keep)
    return concat(_literal(b"-", v.size, neg), digits) if neg.any() else digits


def _pow10(exponent: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """``10^exponent`` (the float64 nearest)."""
    out: npt.NDArray[np.float64] = _POW10[exponent + _POW_MAX]
    return out


def _candidates(
    x: npt.NDArray[np.float64],
    lead: npt.NDArray[np.int64],
    low: npt.NDArray[np.float64],
    high: npt.NDArray[np.float64],
    digits: int,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(inside, m, q)``: ``x``'s nearest decimal ``m * 10^q`` of ``digits`` digits from
    the leading one at ``10^lead``, and whether it lies in ``(low, high)``."""
    q = lead - (digits - 1)
    scale = _pow10(q)
    m = np.rint(x / scale)
    d = m * scale
    return (d > low) & (d < high), m.astype(np.int64), q


def _shortest(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """For finite positive float32 ``x`` ``[n]``: ``(m, q)``, ``m * 10^q`` the shortest
    decimal of at most 9 digits (no trailing zero in ``m``) inside the rounding interval
    of ``x`` by :data:`_MARGIN` (a decimal on the interval's edge is not taken).

    The interval's ends are the midpoints to the float32 neighbours (exact in float64).
    A candidate of ``p`` digits is ``round(x / 10^q) * 10^q``, ``q = E - p + 1`` (``E``
    the leading digit's exponent), computed in float64: within a few 2^-53 of its
    exact value, well inside the margin, so the exact decimal lies inside the interval
    too. The nearest ``p``-digit decimal is no nearer than the nearest ``p + 1``-digit
    one, so the candidates are tried from 9 digits down, each on the values whose longer
    one was inside, until none is."""
    x64 = x.astype(np.float64)
    bits = x.view(np.int32)  # positive finite: the neighbours are the next bit patterns
    below = (bits - 1).view(np.float32).astype(np.float64)
    above = (bits + 1).view(np.float32).astype(np.float64)
    largest = x == np.finfo(np.float32).max
    if largest.any():  # past float32's largest value: its gap below, mirrored
        above[largest] = 2 * x64[largest] - below[largest]
    margin = x64 * _MARGIN
    low = (x64 + below) / 2 + margin
    high = (x64 + above) / 2 - margin
    # The leading digit's exponent (log10 corrected where it lands next to a power; one
    # too low gives a 10-digit 9-digit candidate, one too high the 10-digit fallback).
    e = np.floor(np.log10(x64)).astype(np.int64)
    e += x64 >= _pow10(e + 1)
    e -= x64 < _pow10(e)
    ok, m, q = _candidates(x64, e, low, high, 9)
    if not ok.all():
        missed = ~ok
        _, m[missed], q[missed] = _candidates(x64[missed], e[missed], low[missed], high[missed], 10)
    ok, mp, qp = _candidates(x64, e, low, high, 8)
    m[ok] = mp[ok]
    q[ok] = qp[ok]
    at = np.flatnonzero(ok)
    x64, e, low, high = x64[at], e[at], low[at], high[at]
    for digits in range(7, 0, -1):
        if at.size == 0:
            break
        ok, mp, qp = _candidates(x64, e, low, high, digits)
        at, x64, e, low, high = at[ok], x64[ok], e[ok], low[ok], high[ok]
        m[at] = mp[ok]
        q[at] = qp[ok]
    for _ in range(10):  # trailing zeros (a candidate rounded up to a power of ten)
        zero = m % 10 == 0
        if not zero.any():
            break
        m = np.where(zero, m // 10, m)
        q = q + zero
    return m, q


def json_floats(values: npt.NDArray[np.floating], nonfinite: float) -> Cells:
    """``values`` ``[n]`` (float32, or read as float32) as JSON numbers; a non-finite
    value (``-inf``, ``inf``, NaN) as ``nonfinite`` (itself written the same way).

    Each is the shortest decimal of at most 9 significant digits that reads back as the
    same float32 (:func:`_shortest`), written as Python's ``repr`` writes a float:
    plain where the leading digit's exponent ``E`` is in ``[-4, 15]`` (``-0.000123``,
    ``-12.5``, ``-2.0``: at least one digit after the point), else ``d.ddde-XX`` /
    ``de+XX`` (two exponent digits at least). ``0.0`` and ``-0.0`` keep their sign."""
    v = np.asarray(values, dtype=np.float32).reshape(-1)
    finite = np.isfinite(v)
    if not finite.all():
        v = np.where(finite, v, np.float32(nonfinite))
    n = v.size
    neg = np.signbit(v)
    mag = np.abs(v)
    zero = mag == 0
    if zero.any():
        mag[zero] = 1
    m, q = _shortest(mag)
    m[zero] = 0
    q[zero] = 0
    lead = q + _digit_count(m) - 1  # E: the leading digit's exponent
    sci = (lead < _PLAIN_LOW) | (lead > _PLAIN_HIGH)
    last = np.where(sci, q - lead, q)  # the last digit's place in what is written
    # The integer part (m's digits at places >= 0; 0 when there are none) and the
    # fraction (those at places < 0, at least one written in plain form), as integers.
    up = _INT_POW10[np.maximum(last, 0)]
    down = _INT_POW10[np.maximum(-last, 0)]
    kept = m // down
    whole = kept * up
    n_whole = _digit_count(whole)
    n_frac = np.maximum(-last, np.where(sci, 0, 1))
    whole_cols = int(n_whole.max()) if n else 1
    frac_cols = int(n_frac.max()) if n else 0
    frac = (m - kept * down) * _INT_POW10[frac_cols - np.maximum(-last, 0)]
    pieces: list[Cells | bytes] = [
        _literal(b"-", n, neg),
        Cells.of(
            _digits(whole, whole_cols),
            np.arange(whole_cols)[None, :] >= (whole_cols - n_whole)[:, None],
        ),
    ]
    if frac_cols:
        pieces += [
            _literal(b".", n, n_frac > 0),
            Cells.of(_digits(frac, frac_cols), np.arange(frac_cols)[None, :] < n_frac[:, None]),
        ]
    if sci.any():
        mag_e = np.abs(lead)
        exponent = np.stack(
            [
                np.full(n, ord("e")),
                np.where(lead < 0, ord("-"), ord("+")),
                _ZERO + mag_e // 10,
                _ZERO + mag_e % 10,
            ],
            axis=1,
        ).astype(np.uint8)
        pieces.append(Cells.of(exponent, sci))
    return concat(*pieces)
