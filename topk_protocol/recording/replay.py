"""The replay rules: what a recording can answer exactly, and the message naming what not.

A recording (:mod:`topk_protocol.recording`) answers a request when every sequence has a
recorded row covering its positions (with sampled log-probs when they are asked for, and,
when the sequence names candidate ids, candidate log-probs holding every one of them at
its position: :func:`candidate_logprobs`),
K' <= the recorded K (rows are sorted, so the top-K' is the row's prefix) and the
recorded values give the asked dtype exactly (:func:`~topk_protocol.recording.can_serve_dtype`).
Anything else raises :class:`~topk_protocol.errors.NotRecordedError` naming every
sequence and what is missing: never NaN or zeros in place of requested data.

The student's ``ReplayClient``, its ``PayloadDataset`` and the server's replay backend
all answer through these functions, so a rule (or a new request option a recording must
hold) is written here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol.arrays import SequenceArrays
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingReader, can_serve_dtype
from topk_protocol.requests import RequestOptions

__all__ = [
    "candidate_logprobs",
    "check_options",
    "describe_sequence",
    "find_rows",
    "recorded_arrays",
    "serves_candidates",
    "serves_encodings",
]


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


#: Positions named in full by a message before it says "and N more".
_NAMED_POSITIONS = 8


def candidate_logprobs(
    row: SequenceArrays, start: int, end: int, candidate_ids: npt.NDArray[np.int32]
) -> npt.NDArray[np.float32] | str:
    """The recorded log-probs at ``candidate_ids`` (``[end - start, C]``, ``-1`` padding)
    for positions ``[start, end)`` of ``row``: each id must be among the candidate ids
    recorded at its position (each recorded value is the teacher's exact log-prob of
    that id there, whatever else was asked with it). Returns ``[end - start, C]`` float32
    (NaN at ``-1``), or a sentence naming the positions whose ids are not recorded."""
    if row.candidate_ids is None or row.candidate_logprobs is None:
        return "its candidate log-probs are not recorded (recorded without candidate ids)"
    part = row.positions(start, end)
    assert part.candidate_ids is not None and part.candidate_logprobs is not None
    asked = np.asarray(candidate_ids, dtype=np.int32)
    match = asked[:, :, None] == part.candidate_ids[:, None, :]  # [S, C, R]
    missing = (asked != -1) & ~match.any(axis=2)
    if missing.any():
        rows = np.flatnonzero(missing.any(axis=1))
        named = ", ".join(str(start + int(r)) for r in rows[:_NAMED_POSITIONS])
        more = f" and {len(rows) - _NAMED_POSITIONS} more" if len(rows) > _NAMED_POSITIONS else ""
        r, j = (int(a[0]) for a in np.nonzero(missing))
        return (
            f"candidate_ids at positions [{named}{more}] are not recorded (e.g. id "
            f"{int(asked[r, j])} at position {start + r})"
        )
    found = np.take_along_axis(part.candidate_logprobs, match.argmax(axis=2), axis=1)
    return np.where(asked == -1, np.float32(np.nan), found).astype(np.float32)


def serves_candidates(
    start: int, end: int, candidate_ids: npt.NDArray[np.int32]
) -> Callable[[SequenceArrays], str | None]:
    """``serves`` for ``RecordingReader.find``: None when a row holds these candidate
    ids at positions ``[start, end)`` (:func:`candidate_logprobs`), else why not."""

    def serves(row: SequenceArrays) -> str | None:
        got = candidate_logprobs(row, start, end, candidate_ids)
        return got if isinstance(got, str) else None

    return serves


def find_rows(
    reader: RecordingReader,
    sequences: Sequence[tuple[bytes, int, int] | tuple[bytes, int, int, Any]],
    options: RequestOptions,
    where: str,
) -> list[SequenceArrays | None]:
    """The recorded row answering each ``(token_ids int32 LE bytes, start, end)``, or
    ``(token_ids, start, end, candidate_ids [end - start, C] or None)`` (``None`` for an
    empty range, which needs no row). Raises :class:`NotRecordedError` naming the options
    and every sequence that cannot be answered, and why; a row whose every copy is
    damaged raises the reader's ``RecordingDamagedError``."""
    check_options(reader, options, where)
    rows: list[SequenceArrays | None] = []
    problems: list[str] = []
    for i, (token_ids, start, end, *rest) in enumerate(sequences):
        if start == end:
            rows.append(None)
            continue
        cand = rest[0] if rest else None
        serves = None if cand is None else serves_candidates(start, end, cand)
        found = reader.find(token_ids, start, end, options.include_sampled, serves)
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
    row: SequenceArrays | None,
    start: int,
    end: int,
    options: RequestOptions,
    candidate_ids: npt.NDArray[np.int32] | None = None,
) -> SequenceArrays:
    """Positions ``[start, end)`` of a row found by :func:`find_rows`, cut to
    ``options.top_k`` (views): the teacher's float32 arrays before its cast (the recorded
    values; a ``None`` row: an empty range). ``sampled_logprobs`` is ``None`` when not
    asked; the candidate fields are those of ``candidate_ids`` (``[end - start, C]``,
    looked up by :func:`candidate_logprobs`), None without."""
    arrays = (
        SequenceArrays.empty(options.top_k, start)
        if row is None
        else row.positions(start, end).top(options.top_k)
    )
    cand_lp: npt.NDArray[np.float32] | None = None
    if candidate_ids is not None:
        got = (
            np.zeros(candidate_ids.shape, np.float32)
            if row is None
            else candidate_logprobs(row, start, end, candidate_ids)
        )
        if isinstance(got, str):
            raise NotRecordedError(f"positions [{start}, {end}): {got}")
        cand_lp = got
    sampled = arrays.sampled_logprobs if options.include_sampled else None
    return replace(
        arrays,
        sampled_logprobs=sampled,
        candidate_ids=candidate_ids,
        candidate_logprobs=cand_lp,
    )
