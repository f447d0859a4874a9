"""Streaming corpus readers for ``teacher-record``: a few rows at a time, never the whole input.

An input is cut into **units** that can be read on their own, and a shard of the input
is a contiguous range of units (:func:`shard_range`):

=================================  =========================================  ==============
input                              unit                                       rows known
=================================  =========================================  ==============
Parquet (``.parquet``)             a row group (read in ``batch_rows`` slices) from the footer
Arrow IPC file (``.arrow``...)     a record batch                             no
Arrow IPC stream (``.arrow``...)   a record batch (one pass counts them)      no
JSONL (``.jsonl``, ``.json``)      a 1 MiB block of bytes: the lines that     no
                                   *start* in it
saved ``datasets`` dir             a record batch of its Arrow table          yes
``datasets:NAME_OR_DIR``           a data-source shard (``IterableDataset``)  no
=================================  =========================================  ==============

Files are opened through :func:`topk_protocol.storage.resolve`, so ``s3://`` and other
pyarrow filesystems work like local paths (a saved ``datasets`` directory and
``datasets:`` inputs go through ``datasets`` itself). Only the token column (and, with
several teachers, the teacher column; with candidates, the candidate column) is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from student_client.offline.input_source import (
    TOKEN_COLUMNS,
    Chunk,
    InputError,
    InputSource,
    _chunk,
    _chunks,
    _Extra,
    _pick_column,
    shard_range,
)
from topk_protocol.recording.format import READ_ERRORS
from topk_protocol.storage import resolve

__all__ = [
    "DATASETS_PREFIX",
    "JSONL_BLOCK_BYTES",
    "TOKEN_COLUMNS",
    "Chunk",
    "InputError",
    "InputSource",
    "open_input",
    "shard_range",
]

#: ``--input datasets:NAME_OR_DIR``: a ``datasets.load_dataset(..., streaming=True)`` input.
DATASETS_PREFIX = "datasets:"
#: A JSONL input's unit: the lines that start in one block of this many bytes.
JSONL_BLOCK_BYTES = 1 << 20
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_JSONL_SUFFIXES = (".jsonl", ".json")


class _Parquet(InputSource):
    unit_name = "row group"

    def __init__(self, location: str, fs: pafs.FileSystem, path: str, column: str | None,
                 extra: _Extra, batch_rows: int) -> None:  # fmt: skip
        self.location = location
        self._file = fs.open_input_file(path)
        try:
            self._pq = pq.ParquetFile(self._file)
        except READ_ERRORS as e:
            raise InputError(f"{location}: not a readable Parquet file ({e})") from e
        names = self._pq.schema_arrow.names
        self._column = _pick_column(names, column, location)
        extra.check(names, location)
        self._extra = extra
        self._batch_rows = batch_rows
        self.num_units = self._pq.num_row_groups

    def rows_in(self, units: range) -> int | None:
        return sum(self._pq.metadata.row_group(g).num_rows for g in units)

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        columns = [self._column, *self._extra.names]
        for batch in self._pq.iter_batches(
            batch_size=self._batch_rows, row_groups=[unit], columns=columns
        ):
            yield _chunk(batch, self._column, self._extra, f"{self.location}: row group {unit}")

    def close(self) -> None:
        self._file.close()


class _ArrowFile(InputSource):
    """An Arrow IPC file (random access to its batches)."""

    unit_name = "record batch"

    def __init__(self, location: str, reader: pa.ipc.RecordBatchFileReader, source: Any,
                 column: str | None, extra: _Extra, batch_rows: int) -> None:  # fmt: skip
        self.location = location
        self._source = source
        self._reader = reader
        self._column = _pick_column(reader.schema.names, column, location)
        extra.check(reader.schema.names, location)
        self._extra, self._batch_rows = extra, batch_rows
        self.num_units = reader.num_record_batches

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        batch = self._reader.get_batch(unit)
        where = f"{self.location}: record batch {unit}"
        yield from _chunks(batch, self._column, self._extra, where, self._batch_rows)

    def close(self) -> None:
        self._source.close()


class _ArrowStream(InputSource):
    """An Arrow IPC stream: no index, so one pass counts its batches and each read of a
    shard reads the stream from its start (prefer Parquet or an IPC file for big inputs)."""

    unit_name = "record batch"

    def __init__(self, location: str, fs: pafs.FileSystem, path: str, column: str | None,
                 extra: _Extra, batch_rows: int) -> None:  # fmt: skip
        self.location = location
        self._fs, self._path, self._batch_rows = fs, path, batch_rows
        with fs.open_input_stream(path) as f:
            try:
                reader = pa.ipc.open_stream(f)
            except READ_ERRORS as e:
                raise InputError(f"{location}: not an Arrow IPC file or stream ({e})") from e
            self._column = _pick_column(reader.schema.names, column, location)
            extra.check(reader.schema.names, location)
            n = 0
            try:
                for _ in reader:
                    n += 1
            except READ_ERRORS as e:
                raise InputError(f"{location}: record batch {n} is unreadable ({e})") from e
        self._extra = extra
        self.num_units = n

    def read(self, units: range) -> Iterator[tuple[int, Chunk]]:
        if not units:
            return
        with self._fs.open_input_stream(self._path) as f:
            reader = pa.ipc.open_stream(f)
            for unit in range(units.stop):
                try:
                    batch = reader.read_next_batch()
                except READ_ERRORS as e:
                    raise InputError(
                        f"{self.location}: record batch {unit} is unreadable ({e})"
                    ) from e
                if unit in units:
                    where = f"{self.location}: record batch {unit}"
                    for chunk in _chunks(batch, self._column, self._extra, where, self._batch_rows):
                        yield unit, chunk


def _open_arrow(location: str, fs: pafs.FileSystem, path: str, column: str | None,
                extra: _Extra, batch_rows: int) -> InputSource:  # fmt: skip
    source = fs.open_input_file(path)
    try:
        reader = pa.ipc.open_file(source)
    except READ_ERRORS:
        source.close()
        return _ArrowStream(location, fs, path, column, extra, batch_rows)
    return _ArrowFile(location, reader, source, column, extra, batch_rows)


class _Jsonl(InputSource):
    """JSON lines: a list of ints per line, or an object with the token column. A unit is
    the lines that start in one ``JSONL_BLOCK_BYTES`` block, so a shard seeks straight to
    its bytes (the rule of Hadoop's text splits); blank lines are skipped."""

    unit_name = f"{JSONL_BLOCK_BYTES >> 20} MiB block"

    def __init__(self, location: str, fs: pafs.FileSystem, path: str, column: str | None,
                 extra: _Extra, batch_rows: int) -> None:  # fmt: skip
        self.location = location
        self._file = fs.open_input_file(path)
        self._size = self._file.size()
        self._column, self._extra, self._batch_rows = column, extra, batch_rows
        self.num_units = -(-self._size // JSONL_BLOCK_BYTES)

    def _lines(self, start: int, end: int) -> Iterator[tuple[int, bytes]]:
        """``(offset, line)`` of every line that starts in ``[start, end)``."""
        pos = start
        if start > 0:  # the line running into the block belongs to the block before
            self._file.seek(start - 1)
            pos = start - 1
        else:
            self._file.seek(0)
        buf = b""
        skip = start > 0
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                more = self._file.read(JSONL_BLOCK_BYTES)
                if more:
                    buf += more
                    continue
                if buf and not skip and pos < end:
                    yield pos, buf
                return
            line, buf = buf[: nl + 1], buf[nl + 1 :]
            if not skip:
                if pos >= end:
                    return
                yield pos, line
            skip = False
            pos += len(line)

    def _line_number(self, offset: int) -> str:
        return f"{self.location}: the line at byte {offset}"

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        start = unit * JSONL_BLOCK_BYTES
        teachers, candidates = self._extra.teachers, self._extra.candidates
        tokens: list[npt.NDArray[np.int64]] = []
        names: list[str] = []
        cands: list[npt.NDArray[np.int32]] = []

        def chunk() -> Chunk:
            return Chunk(tokens, names if teachers else None, cands if candidates else None)

        for offset, line in self._lines(start, min(start + JSONL_BLOCK_BYTES, self._size)):
            if not line.strip():
                continue
            where = self._line_number(offset)
            try:
                item = json.loads(line)
            except ValueError as e:
                raise InputError(f"{where} is not JSON ({e})") from None
            for flag, column in (("--teacher-column", teachers),
                                 ("--candidate-column", candidates)):  # fmt: skip
                if column is not None and (not isinstance(item, dict) or column not in item):
                    raise InputError(f"{where}: expected an object with {column!r} ({flag})")
            if teachers is not None:
                if not isinstance(item[teachers], str):
                    raise InputError(f"{where}: {teachers!r} (--teacher-column) is not a string")
                names.append(item[teachers])
            raw = item[candidates] if candidates is not None else None
            if isinstance(item, dict):
                item = item[_pick_column(item.keys(), self._column, where)]
            if not _ints(item):
                raise InputError(f"{where}: expected a list of ints")
            tokens.append(np.asarray(item, dtype=np.int64))
            if candidates is not None:
                cands.append(_candidate_lists(raw, len(item), candidates, where))
            if len(tokens) >= self._batch_rows:
                yield chunk()
                tokens, names, cands = [], [], []
        if tokens:
            yield chunk()

    def close(self) -> None:
        self._file.close()


def _ints(item: Any) -> bool:
    return isinstance(item, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in item
    )


def _candidate_lists(raw: Any, length: int, column: str, where: str) -> npt.NDArray[np.int32]:
    """A JSON row's candidate ids ``[L, C]``: one list of C ints per token."""
    flag = f"--candidate-column {column!r}"
    if not isinstance(raw, list) or not all(_ints(r) for r in raw):
        raise InputError(f"{where}: {flag}: expected a list of lists of ints")
    if len(raw) != length:
        raise InputError(f"{where}: {flag} has {len(raw)} id lists for {length} tokens")
    if len({len(r) for r in raw}) > 1:
        raise InputError(f"{where}: {flag}: id lists of different lengths")
    return np.asarray(raw, dtype=np.int32).reshape(length, len(raw[0]) if raw else 0)


class _SavedDataset(InputSource):
    """A ``datasets`` dataset saved with ``save_to_disk``: its memory-mapped Arrow table,
    a record batch at a time."""

    unit_name = "record batch"

    def __init__(self, location: str, column: str | None, extra: _Extra, batch_rows: int) -> None:
        datasets = _import_datasets(location)
        ds = datasets.load_from_disk(location)
        if not isinstance(ds, datasets.Dataset):
            raise InputError(f"{location}: expected a Dataset, not a {type(ds).__name__}")
        self.location = location
        table = ds.data.table
        self._column = _pick_column(table.column_names, column, location)
        extra.check(table.column_names, location)
        self._extra, self._batch_rows = extra, batch_rows
        self._batches = table.to_batches()  # zero-copy views of the mapped files
        self.num_units = len(self._batches)

    def rows_in(self, units: range) -> int | None:
        return sum(self._batches[u].num_rows for u in units)

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        where = f"{self.location}: record batch {unit}"
        yield from _chunks(self._batches[unit], self._column, self._extra, where, self._batch_rows)


class _StreamedDataset(InputSource):
    """``datasets.load_dataset(NAME_OR_DIR, split=..., streaming=True)``; a unit is one of
    its data-source shards (``IterableDataset.n_shards``)."""

    unit_name = "data-source shard"

    def __init__(self, location: str, split: str, column: str | None, extra: _Extra,
                 batch_rows: int) -> None:  # fmt: skip
        datasets = _import_datasets(location)
        self.location = location
        name = location[len(DATASETS_PREFIX) :]
        self._ds = datasets.load_dataset(name, split=split, streaming=True)
        names = list(self._ds.features or {})
        self._column = _pick_column(names, column, location)
        extra.check(names, location)
        self._extra, self._batch_rows = extra, batch_rows
        self.num_units = int(self._ds.n_shards)

    def read_unit(self, unit: int) -> Iterator[Chunk]:
        part = self._ds.shard(num_shards=self.num_units, index=unit, contiguous=True)
        columns = [self._column, *self._extra.names]
        for batch in part.select_columns(columns).iter(batch_size=self._batch_rows):
            table = pa.table(batch)
            yield _chunk(table, self._column, self._extra, f"{self.location}: shard {unit}")


def _import_datasets(location: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{location}: reading a `datasets` dataset needs `datasets`") from None
    return datasets


def open_input(
    location: str | os.PathLike[str],
    column: str | None = None,
    *,
    teacher_column: str | None = None,
    candidate_column: str | None = None,
    batch_rows: int = 1024,
    split: str = "train",
) -> InputSource:
    """The corpus at ``location`` (a path or URI; see the module's table), reading the
    token ``column`` (default: the first of :data:`TOKEN_COLUMNS`) and, when given,
    ``teacher_column`` and ``candidate_column`` (one list of candidate ids per token);
    ``batch_rows``: most rows per :class:`Chunk`; ``split``: the split
    of a ``datasets:`` input. Raises :class:`InputError` naming the file and the flag."""
    text = os.fspath(location)
    extra = _Extra(teacher_column, candidate_column)
    if text.startswith(DATASETS_PREFIX):
        return _StreamedDataset(text, split, column, extra, batch_rows)
    fs, path = resolve(text)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"--input {text}: no such file or directory")
    if info.type == pafs.FileType.Directory:
        if not isinstance(fs, pafs.LocalFileSystem):
            raise InputError(f"--input {text}: a saved `datasets` directory must be local")
        return _SavedDataset(path, column, extra, batch_rows)
    suffix = os.path.splitext(path)[1]
    if suffix == ".parquet":
        return _Parquet(text, fs, path, column, extra, batch_rows)
    if suffix in _ARROW_SUFFIXES:
        return _open_arrow(text, fs, path, column, extra, batch_rows)
    if suffix in _JSONL_SUFFIXES:
        return _Jsonl(text, fs, path, column, extra, batch_rows)
    raise InputError(
        f"--input {text}: use .parquet, .arrow, .jsonl, a saved dataset directory or "
        f"{DATASETS_PREFIX}NAME"
    )
