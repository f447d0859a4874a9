"""One ``teacher-record`` shard: its input rows through the teacher into its part, overlapped.

Four threads keep the work overlapped (pyarrow, numpy, hashlib and zlib release the GIL):

- the **input thread** reads the shard's units (:mod:`.inputs`), skips the rows already
  recorded (resume) and the repeats of a sequence, and queues request batches, at most
  ``max_inflight`` of them;
- the client's **event loop** keeps ``depth`` requests at the teacher, and hands each
  answer to the recording writer (decoding it into the rows to store);
- the writer's **flush thread** checksums, compresses and writes the rows every
  ``flush_interval_s`` (:mod:`topk_protocol.recording.writer`);
- the **caller's thread** only counts the answers and draws the progress bar.

Memory is bounded by the batches in flight, whatever the corpus size: ``max_inflight``
queued batches, ``depth`` at the teacher, the rows answered in the writer's last flush
interval, plus the keys of the part's recorded rows (32 bytes and about 70 of Python per
row) that resuming needs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from student_client.data.batch import ScoreBatch
from student_client.offline.inputs import InputError, InputSource
from topk_protocol.recording.format import (
    METADATA_FILE,
    READ_ERRORS,
    SHARD_SUFFIX,
    sequence_key,
)
from topk_protocol.recording.multi_recording import read_manifest
from topk_protocol.recording.sharded import join
from topk_protocol.storage import resolve

__all__ = [
    "ShardStats",
    "candidates_digest",
    "files_bytes",
    "recorded_keys",
    "recording_dirs",
    "seal_cut_shards",
    "stream_shard",
]

_END = object()


@dataclass
class ShardStats:
    """What one shard's run did: input rows read, rows already recorded (skipped),
    repeats of an earlier row, rows and positions scored now, and seconds."""

    rows_read: int = 0
    already: int = 0
    repeats: int = 0
    rows: int = 0
    positions: int = 0
    seconds: float = 0.0
    units_done: int = 0
    error: BaseException | None = field(default=None, repr=False)


def recording_dirs(part: str) -> list[tuple[str | None, str]]:
    """``(teacher or None, recording location)`` of each recording of a part (several for
    a multi-teacher part)."""
    fs, path = resolve(part)
    if isinstance(fs, pafs.LocalFileSystem):
        names = read_manifest(path)
        if names is not None:
            return [(n, join(part, n)) for n in names]
    return [(None, part)]


def _shard_files(location: str) -> tuple[pafs.FileSystem, list[str]]:
    fs, path = resolve(location)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return fs, sorted(
        i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(SHARD_SUFFIX)
    )


def candidates_digest(candidate_ids: Any) -> bytes:
    """What a row's candidate ids ``[S, C]`` add to its resume key: empty for None, else
    a marker and the sha256 of the ids (int32, trailing all-``-1`` columns dropped, so a
    row padded to a batch's wider C keys the same)."""
    if candidate_ids is None:
        return b""
    ids = np.asarray(candidate_ids, dtype="<i4")
    if ids.ndim != 2:  # an empty row: ``[]``
        ids = ids.reshape(len(ids), 0)
    width = ids.shape[1]
    while width and (ids[:, width - 1] == -1).all():
        width -= 1
    ids = np.ascontiguousarray(ids[:, :width])
    return b"\0c" + hashlib.sha256(width.to_bytes(4, "little") + ids.tobytes()).digest()


def _read_keys(fs: pafs.FileSystem, path: str, candidates: bool) -> Iterator[bytes]:
    """The ``key`` column of every complete batch of one shard file, each followed by
    :func:`candidates_digest` of its row's ``candidate_ids`` when ``candidates`` (no
    other column is read or decompressed); a cut or damaged tail ends it, as it ends
    the reader."""
    try:
        fields = [0]
        if candidates:
            with fs.open_input_file(path) as f:
                index = pa.ipc.open_stream(f).schema.get_field_index("candidate_ids")
            fields += [index] if index >= 0 else []
        options = pa.ipc.IpcReadOptions(included_fields=fields)
        with fs.open_input_file(path) as f:
            reader = pa.ipc.open_stream(f, options=options)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                keys = batch.column(0).to_pylist()
                if len(fields) == 1:
                    yield from keys
                    continue
                for key, ids in zip(keys, batch.column(1).to_pylist(), strict=True):
                    yield key + candidates_digest(ids)
    except READ_ERRORS:
        return


def recorded_keys(part: str, candidates: bool = False) -> set[bytes]:
    """The rows recorded in a part: each one's key, then (``candidates``) the
    :func:`candidates_digest` of its candidate ids, then its teacher's name (empty for a
    single-teacher part), read from the key (and candidate) columns alone."""
    keys: set[bytes] = set()
    for name, location in recording_dirs(part):
        suffix = (name or "").encode()
        fs, files = _shard_files(location)
        for path in files:
            keys.update(k + suffix for k in _read_keys(fs, path, candidates))
    return keys


def seal_cut_shards(part: str) -> list[str]:
    """Rewrite each shard file of a local part that a killed writer left cut (its last
    batch incomplete) as its complete batches, and remove files with no complete batch,
    so that plain pyarrow and ``datasets`` read every file; returns what it changed.
    No row is lost: the reader never served a cut batch. Object stores hold whole
    objects only, so there is nothing to seal there."""
    fs, _ = resolve(part)
    if not isinstance(fs, pafs.LocalFileSystem):
        return []
    changed = []
    for _, location in recording_dirs(part):
        for path in _shard_files(location)[1]:
            batches: list[pa.RecordBatch] = []
            schema = None
            cut = False
            try:
                with pa.memory_map(path) as src:
                    reader = pa.ipc.open_stream(src)
                    schema = reader.schema
                    for batch in reader:
                        batches.append(batch)
            except READ_ERRORS:
                cut = True
            if not cut:
                continue
            if not batches or schema is None:
                os.remove(path)
                changed.append(f"sealing {path}: removed (no complete batch)")
                continue
            tmp = f"{path}.sealing"
            codec = _compression(location)
            with (
                pa.OSFile(tmp, "wb") as out,
                pa.ipc.new_stream(
                    out, schema, options=pa.ipc.IpcWriteOptions(compression=codec)
                ) as w,
            ):
                for batch in batches:
                    w.write_batch(batch)
            os.replace(tmp, path)
            changed.append(f"sealing {path}: kept its {len(batches)} complete batches")
    return changed


def _compression(location: str) -> str | None:
    """The recording's buffer codec (``metadata.json``), for a sealed file."""
    try:
        meta = json.loads((Path(location) / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return "zstd"
    codec = meta.get("compression", "zstd") if isinstance(meta, dict) else "zstd"
    return None if codec == "none" else str(codec)


def _batches(
    source: InputSource,
    units: range,
    batch_size: int,
    recorded: set[bytes],
    stats: ShardStats,
    teachers: frozenset[str] | None,
) -> Iterator[tuple[Any, int, int]]:
    """``(request batch, rows, positions)`` of the shard's rows not recorded yet; a row
    already in ``recorded`` counts as ``already``, a repeat of an earlier row of the
    shard as ``repeats`` (with candidate ids, a row is the tokens and its candidates).
    Keys move from ``recorded`` to a set of the rows seen, so the two together hold each
    key once."""
    seen: set[bytes] = set()
    seqs: list[np.ndarray] = []
    names: list[str] = []
    cands: list[np.ndarray] = []
    last_unit = None

    def flush() -> tuple[Any, int, int]:
        batch: Any = list(seqs)
        if teachers is not None or cands:
            batch = ScoreBatch(
                batch,
                teacher=None if teachers is None else list(names),
                candidate_ids=list(cands) if cands else None,
            )
        out = (batch, len(seqs), sum(len(s) for s in seqs))
        seqs.clear()
        names.clear()
        cands.clear()
        return out

    try:
        for unit, chunk in source.read(units):
            if unit != last_unit and last_unit is not None:
                stats.units_done += 1
            last_unit = unit
            for j, tokens in enumerate(chunk.tokens):
                stats.rows_read += 1
                name = chunk.teachers[j] if chunk.teachers is not None else ""
                if teachers is not None and name not in teachers:
                    raise InputError(
                        f"{source.location}: {source.unit_name} {unit}: the teacher column names "
                        f"{name!r}, not among --teacher {sorted(teachers)}"
                    )
                ids = chunk.candidates[j] if chunk.candidates is not None else None
                key = sequence_key(tokens.astype("<i4")) + candidates_digest(ids) + name.encode()
                if key in seen:
                    stats.repeats += 1
                    continue
                seen.add(key)
                if key in recorded:
                    recorded.discard(key)
                    stats.already += 1
                    continue
                seqs.append(tokens)
                names.append(name)
                if ids is not None:
                    cands.append(ids)
                if len(seqs) == batch_size:
                    yield flush()
    except (InputError, *READ_ERRORS):
        if seqs:  # the rows read before the error are scored and recorded
            yield flush()
        raise
    if last_unit is not None:
        stats.units_done += 1
    if seqs:
        yield flush()


def stream_shard(
    stream_answers: Callable[[AsyncIterator[Any]], Iterator[Any]],
    source: InputSource,
    units: range,
    *,
    batch_size: int,
    max_inflight: int,
    recorded: set[bytes],
    teachers: frozenset[str] | None = None,
    on_progress: Callable[[ShardStats], None] | None = None,
) -> ShardStats:
    """Score the rows of ``units`` not in ``recorded`` (:func:`recorded_keys`, with
    ``candidates`` when the source reads a candidate column) through
    ``stream_answers`` (a client's, recording its answers); ``teachers``: the names a
    multi-teacher input's rows may route to (None: one teacher). An input error ends the
    stream after the rows before it are answered and recorded, then is raised."""
    stats = ShardStats()
    q: queue.Queue[Any] = queue.Queue(maxsize=max(1, max_inflight))
    stop = threading.Event()
    pending: list[tuple[int, int]] = []  # (rows, positions) of each batch sent, in order

    def produce() -> None:
        try:
            for item in _batches(source, units, batch_size, recorded, stats, teachers):
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except (InputError, *READ_ERRORS) as e:
            stats.error = e
        finally:
            q.put(_END)

    async def requests() -> AsyncIterator[Any]:
        while True:
            item = await asyncio.to_thread(q.get)
            if item is _END:
                return
            batch, rows, positions = item
            pending.append((rows, positions))
            yield batch

    t0 = time.monotonic()
    reader = threading.Thread(target=produce, daemon=True, name="teacher-record-input")
    reader.start()
    try:
        for _answer in stream_answers(requests()):
            rows, positions = pending.pop(0)
            stats.rows += rows
            stats.positions += positions
            stats.seconds = time.monotonic() - t0
            if on_progress is not None:
                on_progress(stats)
    finally:
        stop.set()
        reader.join()
        stats.seconds = time.monotonic() - t0
    if stats.error is not None:
        raise stats.error
    return stats


def files_bytes(part: str) -> int:
    """Bytes of a part's shard files (every recording of it)."""
    total = 0
    for _, location in recording_dirs(part):
        fs, files = _shard_files(location)
        total += sum(i.size or 0 for i in fs.get_file_info(files)) if files else 0
    return total
