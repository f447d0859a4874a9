"""The replay rules: what a recording can answer exactly, and the message naming what not.

A recording (:mod:`topk_protocol.recording`) answers a request when every sequence has a
recorded row covering its positions (with sampled log-probs when they are asked for),
K' <= the recorded K (rows are sorted, so the top-K' is the row's prefix) and the
recorded values give the asked dtype exactly (:func:`~topk_protocol.recording.can_serve_dtype`).
Anything else raises :class:`~topk_protocol.errors.NotRecordedError` naming every
sequence and what is missing: never NaN or zeros in place of requested data.

The student's ``ReplayClient``, its ``PayloadDataset`` and the server's replay backend
all answer through these functions, so a rule (or a new request option a recording must
hold) is written here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from topk_protocol._deprecation import deprecated_names
from topk_protocol.arrays import SequenceArrays
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingReader, can_serve_dtype
from topk_protocol.requests import RequestOptions

__all__ = [
    "check_options",
    "describe_sequence",
    "find_rows",
    "recorded_arrays",
    "serves_encodings",
]

__getattr__ = deprecated_names(
    __name__, {"RecordedArrays": ("topk_protocol.SequenceArrays", SequenceArrays)}
)


def describe_sequence(index: int, token_ids: bytes | npt.ArrayLike, max_tokens: int = 8) -> str:
    """``sequences[i] (L tokens starting [a, b, ...])``: how messages name a sequence."""
    if isinstance(token_ids, bytes | bytearray | memoryview):
        ids = np.frombuffer(token_ids, dtype="<i4")
    else:
        ids = np.asarray(token_ids)
    more = ", ..." if len(ids) > max_tokens else ""
    first = ", ".join(map(str, ids[:max_tokens].tolist()))
    return f"sequences[{index}] ({len(ids)} tokens starting [{first}{more}])"


def serves_encodings(reader: RecordingReader) -> tuple[str, ...]:
    """The payload encodings a recording answers: a packed one only ``"packed"`` (at its
    bits, dtype and K); a float32 one both (the teacher packs its float32 values); a
    float16 or bfloat16 one only ``"default"``."""
    if reader.packing is not None:
        return ("packed",)
    return ("default", "packed") if reader.dtype == "float32" else ("default",)


def _check_packing(reader: RecordingReader, options: RequestOptions, where: str) -> None:
    """The encoding rules of :func:`serves_encodings`, naming the field that differs."""
    if options.encoding not in serves_encodings(reader):
        held = "packed" if reader.packing is not None else f"{reader.dtype}"
        raise NotRecordedError(
            f"{where}: encoding: the recording holds {held} payloads, which do not give "
            f"{options.encoding!r} ones exactly (packed answers come from a packed "
            "recording of the same bits, dtype and K, or from a float32 recording)"
        )
    packing = reader.packing
    if packing is None:
        return
    for name, recorded, asked in (
        ("logprob_bits", packing.logprob_bits, options.logprob_bits),
        ("dtype", reader.dtype, options.dtype),
        ("top_k", reader.top_k, options.top_k),
    ):
        if recorded != asked:
            raise NotRecordedError(
                f"{where}: {name}: the packed recording holds {recorded!r}, the request asks "
                f"for {asked!r}; a packed recording answers its own {name} only (another "
                "one moves the row's grid)"
            )


def check_options(reader: RecordingReader, options: RequestOptions, where: str) -> None:
    """Raise :class:`NotRecordedError` (message starting with ``where``) unless the
    recording holds enough K, a dtype that gives ``options.dtype`` exactly and an
    encoding that gives ``options.encoding`` exactly (:func:`serves_encodings`)."""
    _check_packing(reader, options, where)
    if options.top_k > reader.top_k:
        raise NotRecordedError(
            f"{where}: top_k: {options.top_k} is more than the recorded K {reader.top_k}"
        )
    if not can_serve_dtype(reader.dtype, options.dtype):
        raise NotRecordedError(
            f"{where}: dtype: the recording holds {reader.dtype} log-probs, which do not "
            f"give the teacher's {options.dtype} values exactly (only a float32 recording "
            "serves every dtype)"
        )
    defaults = type(options).recorded_defaults()  # a recording older than the option
    for name, value in options.recorded().items():
        recorded = reader.options.get(name, defaults[name])
        if value != recorded:
            raise NotRecordedError(
                f"{where}: {name}: the recording was made at {recorded!r}, the request asks "
                f"for {value!r}"
            )


def find_rows(
    reader: RecordingReader,
    sequences: Sequence[tuple[bytes, int, int]],
    options: RequestOptions,
    where: str,
) -> list[SequenceArrays | None]:
    """The recorded row answering each ``(token_ids int32 LE bytes, start, end)``
    (``None`` for an empty range, which needs no row). Raises :class:`NotRecordedError`
    naming the options and every sequence that cannot be answered, and why; a row whose
    every copy is damaged raises the reader's ``RecordingDamagedError``."""
    check_options(reader, options, where)
    rows: list[SequenceArrays | None] = []
    problems: list[str] = []
    for i, (token_ids, start, end) in enumerate(sequences):
        if start == end:
            rows.append(None)
            continue
        found = reader.find(token_ids, start, end, options.include_sampled)
        if isinstance(found, str):
            problems.append(f"{describe_sequence(i, token_ids)}: {found}")
            rows.append(None)
        else:
            rows.append(found)
    if problems:
        raise NotRecordedError(
            f"{where}: not recorded at top_k {options.top_k}, dtype {options.dtype}, "
            f"include_sampled {options.include_sampled}: " + "; ".join(problems)
        )
    return rows


def recorded_arrays(
    row: SequenceArrays | None, start: int, end: int, options: RequestOptions
) -> SequenceArrays:
    """Positions ``[start, end)`` of a row found by :func:`find_rows`, cut to
    ``options.top_k`` (views): the teacher's float32 arrays before its cast (the recorded
    values; a ``None`` row: an empty range). ``sampled_logprobs`` is ``None`` when not
    asked."""
    arrays = (
        SequenceArrays.empty(options.top_k, start)
        if row is None
        else row.positions(start, end).top(options.top_k)
    )
    return arrays if options.include_sampled else replace(arrays, sampled_logprobs=None)
