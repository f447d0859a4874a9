"""The one index of a recording's rows: which rows hold which sequence, and what positions.

The reader fills it from the shards it opens; the writer fills it from the recording it
resumes and adds every row it writes. Every lookup (is this sequence recorded? which
row answers these positions? is a row's key what it says?) goes through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NOT_RECORDED", "RowIndex", "RowSpan"]

#: What :meth:`RowIndex.covering` says of a sequence with no row at all.
NOT_RECORDED = "the sequence is not recorded"


@dataclass(frozen=True)
class RowSpan:
    """One recorded row of a sequence: its number (in shard order), its positions
    ``[start, end)`` and whether it holds sampled log-probs."""

    row: int
    start: int
    end: int
    has_sampled: bool


class RowIndex:
    """Row number -> key, and key -> every :class:`RowSpan` of that sequence.

    Rows are numbered in the order they are added (the reader's shard order). The
    key -> rows map is built on the first lookup, so opening a recording only reads the
    keys.
    """

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._spans: list[tuple[int, int, bool]] = []
        self._by_key: dict[bytes, list[RowSpan]] | None = None

    def extend(
        self,
        keys: Sequence[bytes],
        starts: Sequence[int],
        ends: Sequence[int],
        has_sampled: Sequence[bool],
    ) -> None:
        """Append rows (equal-length columns of Python values, in row order)."""
        if self._by_key is not None:
            for key, start, end, sampled in zip(keys, starts, ends, has_sampled, strict=True):
                self.add(key, start, end, sampled)
            return
        self._keys.extend(keys)
        self._spans.extend(zip(starts, ends, has_sampled, strict=True))

    def add(self, key: bytes, start: int, end: int, has_sampled: bool) -> int:
        """Append one row; returns its number."""
        row = len(self._keys)
        self._keys.append(key)
        self._spans.append((start, end, has_sampled))
        if self._by_key is not None:
            self._by_key.setdefault(key, []).append(RowSpan(row, start, end, has_sampled))
        return row

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, row: int) -> bytes:
        return self._keys[row]

    def rows_of(self, key: bytes) -> list[RowSpan]:
        """Every recorded row of the sequence with this key (empty: none)."""
        if self._by_key is None:
            by_key: dict[bytes, list[RowSpan]] = {}
            for row, (key_, (start, end, sampled)) in enumerate(
                zip(self._keys, self._spans, strict=True)
            ):
                by_key.setdefault(key_, []).append(RowSpan(row, start, end, sampled))
            self._by_key = by_key
        return self._by_key.get(key, [])

    def covering(self, key: bytes, start: int, end: int, sampled: bool) -> list[RowSpan] | str:
        """The rows holding positions ``[start, end)`` of this sequence (with sampled
        log-probs when ``sampled``), or a sentence saying what is missing."""
        found = self.rows_of(key)
        if not found:
            return NOT_RECORDED
        covering = [c for c in found if c.start <= start and end <= c.end]
        if not covering:
            have = ", ".join(f"[{c.start}, {c.end})" for c in found)
            return f"positions [{start}, {end}) are not recorded (recorded: {have})"
        if sampled:
            covering = [c for c in covering if c.has_sampled]
            if not covering:
                return "its sampled log-probs are not recorded (recorded without them)"
        return covering
