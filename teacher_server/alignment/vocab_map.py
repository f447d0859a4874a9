"""Teacher ids to student ids by identical bytes, and a teacher top-k row in student ids.

**The map.** Teacher id ``τ`` maps to student id ``s`` when both stand for the same
non-empty bytes (:mod:`.token_bytes`) and both are text, or both are special tokens
with the same content (a special never maps to text, nor text to a special). Example:
a byte-level student and a byte-level BPE teacher share the 256 single bytes and their
special tokens of identical content; the teacher's merged ``'Ġhello'`` (``b' hello'``)
maps where the student has a token ``b' hello'`` too, and is unmapped (-1) otherwise.

**One id per byte string.** A tokenizer may give two ids the same bytes (SentencePiece's
fallback ``<0x41>`` and the piece ``A``; an added token repeating a piece). Each side
keeps one id per byte string: a regular piece before a fallback byte, then the lowest
id. So the map is injective (two teacher ids never share a student id) and a teacher
row never needs merging; the other teacher ids of a repeated byte string are unmapped
(their mass goes to the tail, below).

**The projection.** :func:`project_topk` writes a teacher top-k row in student ids: the
mapped entries keep their teacher log-probs (sorted, descending), the unmapped ones are
dropped, and the row is refilled to ``K`` columns with padding. The student row then
names only student tokens whose bytes are one teacher token; the dropped teacher mass,
and every student token that spans several teacher tokens, lie in the tail
(``1 - sum(exp(logprobs))``), which the tail-aware losses keep as one category.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from teacher_server.alignment.token_bytes import TokenBytes

__all__ = ["UNMAPPED", "VocabMap", "build_vocab_map", "project_topk"]

#: A teacher id with no student id of the same bytes.
UNMAPPED = -1


@dataclass(frozen=True, eq=False)
class VocabMap:
    """Teacher ids to student ids (module doc).

    Attributes:
        teacher_to_student: ``[Vt]`` int32: the student id of teacher id ``τ``, or
            :data:`UNMAPPED`; no student id appears twice.
        student_vocab_size: ``Vs``, the number of student ids (the padding's range).
    """

    teacher_to_student: npt.NDArray[np.int32]
    student_vocab_size: int


def build_vocab_map(teacher: TokenBytes, student: TokenBytes) -> VocabMap:
    """The map of ``teacher``'s ids to ``student``'s (built once per tokenizer pair).

    Args:
        teacher: the teacher tokenizer's :class:`~.token_bytes.TokenBytes` (``Vt`` ids).
        student: the student's (``Vs`` ids).

    Returns:
        The :class:`VocabMap`: ``[Vt]`` int32, -1 where unmapped.
    """
    student_ids = _canonical_ids(student)
    out = np.full(teacher.vocab_size, UNMAPPED, dtype=np.int32)
    for key, t in _canonical_ids(teacher).items():
        s = student_ids.get(key)
        if s is not None:
            out[t] = s
    return VocabMap(out, student.vocab_size)


def project_topk(
    teacher_ids: npt.ArrayLike, teacher_logprobs: npt.ArrayLike, vocab_map: VocabMap
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.floating]]:
    """A teacher top-k payload ``[S, K]`` in student ids.

    Args:
        teacher_ids: ``[S, K]`` teacher ids in ``[0, Vt)``, distinct within a row.
        teacher_logprobs: ``[S, K]`` their log-probs.
        vocab_map: from :func:`build_vocab_map`.

    Returns:
        ``(student_ids, student_logprobs)``: ``[S, K]`` int32 and ``[S, K]`` of
        ``teacher_logprobs``' float dtype. Each row holds the mapped entries first, sorted
        by log-prob descending (ties in teacher order), with the teacher's log-probs
        unchanged; then padding columns to ``K``: log-prob ``-inf`` (probability 0) and
        distinct student ids absent from the row (the smallest such ids), because a
        payload row is always ``K`` wide and the losses require distinct in-range ids
        (a ``-inf`` column is a category of mass 0). A row's top-k mass is that of its
        mapped entries; the rest is its tail.

    Raises:
        ValueError: shapes that differ or are not ``[S, K]``, an id outside ``[0, Vt)``,
            or ``K > Vs`` (a row of ``K`` distinct student ids cannot exist).
    """
    ids = np.asarray(teacher_ids)
    logprobs = np.asarray(teacher_logprobs)
    if ids.ndim != 2 or logprobs.shape != ids.shape:
        raise ValueError(
            f"teacher_ids, teacher_logprobs: expected [S, K] each, got {ids.shape} and "
            f"{logprobs.shape}"
        )
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"teacher_ids: expected integers, got {ids.dtype}")
    if not np.issubdtype(logprobs.dtype, np.floating):
        logprobs = logprobs.astype(np.float32)
    table = vocab_map.teacher_to_student
    top_k = ids.shape[1]
    if top_k > vocab_map.student_vocab_size:
        raise ValueError(
            f"K: {top_k} columns exceed the student's {vocab_map.student_vocab_size} ids"
        )
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise ValueError(f"teacher_ids: must lie in [0, {table.shape[0]})")

    mapped = table[ids].astype(np.int64)
    keep = mapped != UNMAPPED
    # mapped first (primary key), then log-prob descending; lexsort is stable
    order = np.lexsort((-logprobs, ~keep), axis=-1)
    student_ids = np.take_along_axis(mapped, order, axis=-1)
    student_logprobs = np.take_along_axis(logprobs, order, axis=-1)

    kept = keep.sum(axis=-1)
    padding = np.arange(top_k)[None, :] >= kept[:, None]
    student_ids = np.where(padding, _padding_ids(mapped, keep, kept, vocab_map), student_ids)
    student_logprobs = np.where(padding, -np.inf, student_logprobs).astype(logprobs.dtype)
    return student_ids.astype(np.int32), student_logprobs


def _padding_ids(
    mapped: npt.NDArray[np.int64],
    keep: npt.NDArray[np.bool_],
    kept: npt.NDArray[np.int64],
    vocab_map: VocabMap,
) -> npt.NDArray[np.int64]:
    """``[S, K]``: at column ``c >= kept[r]`` of row ``r``, the ``(c - kept[r])``-th
    smallest student id absent from the row's mapped ids (other columns: anything).

    The ids are drawn from ``[0, min(2K, Vs))``: a row uses at most ``kept`` of them, so
    at least ``K - kept`` are free whenever ``K <= Vs``."""
    rows, top_k = mapped.shape
    width = min(2 * top_k, vocab_map.student_vocab_size)
    used = np.zeros((rows, width), dtype=np.bool_)
    r, c = np.nonzero(keep & (mapped < width))
    used[r, mapped[r, c]] = True
    free = np.argsort(used, axis=-1, kind="stable")  # free ids first, ascending
    rank = np.clip(np.arange(top_k)[None, :] - kept[:, None], 0, width - 1)
    return np.take_along_axis(free, rank, axis=-1)


def _canonical_ids(table: TokenBytes) -> dict[tuple[bool, bytes], int]:
    """One id per (special, bytes) of non-empty bytes: a piece that is not a fallback
    byte first, then the lowest id."""
    ids = np.flatnonzero(table.lengths > 0)
    order = ids[np.lexsort((ids, table.fallback[ids]))]
    out: dict[tuple[bool, bytes], int] = {}
    for i, special, piece in zip(
        order.tolist(), table.special[order].tolist(), table.pieces[order].tolist(), strict=True
    ):
        out.setdefault((special, piece), i)
    return out
