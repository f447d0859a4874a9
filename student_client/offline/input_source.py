"""The common ground of the recorder's input formats: a chunk of token sequences (with
their candidate ids), how a column is picked and read into chunks, shard ranges, and the
``InputSource`` interface each format implements (``inputs.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from topk_protocol.recording.format import READ_ERRORS

__all__ = ["TOKEN_COLUMNS", "Chunk", "InputError", "InputSource", "shard_range"]

#: Column names taken as the token ids, in this order, when no column is named.
TOKEN_COLUMNS = ("input_ids", "token_ids", "tokens")


class InputError(ValueError):
    """An input that cannot be read as a token corpus; the message names the file and
    the flag or the unit (row group, batch, line)."""


@dataclass(frozen=True)
class Chunk:
    """A few consecutive rows of one unit: ``tokens`` ``[L_i]`` int64 each, each row's
    teacher name (only when a teacher column was asked for) and each row's candidate ids
    ``[L_i, C_i]`` int32, ``-1`` padding (only when a candidate column was asked for)."""

    tokens: list[npt.NDArray[np.int64]]
    teachers: list[str] | None
    candidates: list[npt.NDArray[np.int32]] | None = None


@dataclass(frozen=True)
class _Extra:
    """The columns read besides the tokens: ``teachers`` (names) and ``candidates``
    (one list of candidate ids per token), each None when not asked for."""

    teachers: str | None = None
    candidates: str | None = None

    @property
    def names(self) -> list[str]:
        return [c for c in (self.teachers, self.candidates) if c is not None]

    def check(self, names: Iterable[str], source: str) -> None:
        names = list(names)
        for flag, column in (("--teacher-column", self.teachers),
                             ("--candidate-column", self.candidates)):  # fmt: skip
            if column is not None and column not in names:
                raise InputError(f"{flag} {column!r} is not in {source} ({names})")


def shard_range(num_units: int, index: int, num_shards: int) -> range:
    """The units of shard ``index`` of ``num_shards``: contiguous, disjoint, covering
    ``range(num_units)`` in order; the first ``num_units % num_shards`` shards get one
    unit more (the rule of ``datasets``' ``shard(contiguous=True)``)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in [0, {num_shards})")
    div, mod = divmod(num_units, num_shards)
    start = div * index + min(index, mod)
    return range(start, start + div + (1 if index < mod else 0))


def _pick_column(names: Iterable[str], column: str | None, source: str) -> str:
    names = list(names)
    if column is not None:
        if column not in names:
            raise InputError(f"--column {column!r} is not in {source} ({names})")
        return column
    for name in TOKEN_COLUMNS:
        if name in names:
            return name
    raise InputError(
        f"{source} has no token column ({', '.join(TOKEN_COLUMNS)}); its columns are "
        f"{names}: pass --column"
    )


def _flat(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _is_list(typ: pa.DataType) -> bool:
    return bool(pa.types.is_list(typ) or pa.types.is_large_list(typ))


def _candidate_rows(
    col: pa.Array, tokens: list[npt.NDArray[np.int64]], column: str, where: str
) -> list[npt.NDArray[np.int32]]:
    """Each row's candidate ids ``[L_i, C_i]`` from a ``list<list<int>>`` column: one list
    of ids per token, every list of a row the same length."""
    flag = f"--candidate-column {column!r}"
    if not (
        _is_list(col.type)
        and _is_list(col.type.value_type)
        and pa.types.is_integer(col.type.value_type.value_type)
    ):
        raise InputError(f"{where}: {flag} is {col.type}, not a list of lists of integers")
    if col.null_count:
        raise InputError(f"{where}: {flag} has {col.null_count} null rows")
    outer = col.offsets.to_numpy()
    inner = col.values.offsets.to_numpy()
    values = col.values.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    out = []
    for i, toks in enumerate(tokens):
        first, last = int(outer[i]), int(outer[i + 1])
        widths = np.diff(inner[first : last + 1])
        if last - first != len(toks):
            raise InputError(
                f"{where}: row {i}: {flag} has {last - first} id lists for {len(toks)} tokens"
            )
        if len(widths) and (widths != widths[0]).any():
            raise InputError(f"{where}: row {i}: {flag}: id lists of different lengths")
        c = int(widths[0]) if len(widths) else 0
        out.append(values[inner[first] : inner[last]].reshape(len(toks), c))
    return out


def _chunk(batch: pa.RecordBatch | pa.Table, column: str, extra: _Extra, where: str) -> Chunk:
    """The token lists (and teacher names, candidate ids) of an Arrow batch; ``where``
    names it."""
    col = _flat(batch.column(column))
    if not _is_list(col.type) or not (pa.types.is_integer(col.type.value_type)):
        raise InputError(f"{where}: column {column!r} is {col.type}, not a list of integers")
    if col.null_count:
        raise InputError(f"{where}: column {column!r} has {col.null_count} null rows")
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    tokens = [values[offsets[i] : offsets[i + 1]] for i in range(len(col))]
    names = None
    if extra.teachers is not None:
        names = batch.column(extra.teachers).to_pylist()
        if not all(isinstance(n, str) for n in names):
            raise InputError(f"{where}: --teacher-column {extra.teachers!r} must hold strings")
    cands = None
    if extra.candidates is not None:
        cands = _candidate_rows(
            _flat(batch.column(extra.candidates)), tokens, extra.candidates, where
        )
    return Chunk(tokens, names, cands)


def _chunks(
    batch: pa.RecordBatch, column: str, extra: _Extra, where: str, rows: int
) -> Iterator[Chunk]:
    """:func:`_chunk` of ``rows``-row slices of ``batch`` (zero-copy slices)."""
    for offset in range(0, batch.num_rows, rows):
        yield _chunk(batch.slice(offset, rows), column, extra, where)


class InputSource:
    """One corpus, cut into units (see the module's table). Subclasses set
    ``num_units`` and ``unit_name`` and implement :meth:`read_unit`."""

    location: str
    num_units: int
    unit_name: str

    def rows_in(self, units: range) -> int | None:
        """Rows of ``units`` when the input says so without reading them, else None."""
        return None

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        """The rows of one unit, a chunk at a time."""
        raise NotImplementedError

    def read(self, units: range) -> Iterator[tuple[int, Chunk]]:
        """``(unit, chunk)`` of every unit in ``units``, in order; a unit that does not
        read raises :class:`InputError` naming the file and the unit."""
        for unit in units:
            try:
                for chunk in self.read_unit(unit):
                    yield unit, chunk
            except InputError:
                raise
            except READ_ERRORS as e:
                raise InputError(
                    f"{self.location}: {self.unit_name} {unit} is unreadable "
                    f"({type(e).__name__}: {e})"
                ) from e

    def close(self) -> None:
        pass
