"""A student's payload rows from the teacher's answer to the same bytes.

Given the :class:`~.boundaries.Alignment` of a student sequence to the teacher's and the
teacher's top-k rows, this builds the student rows ``[start, end)`` as the payload carries
them (docs/cross_tokenizer.md, "Serving it"):

- a ``BOUNDARY`` or ``ALIGNED`` row: the teacher's row at the same byte prefix, its top-k
  projected into student ids (:func:`~.vocab_map.project_topk`);
- an ``ALIGNED`` row's ``sampled_logprobs``: the chain-rule log-prob of the next student
  token (:func:`~.chain.chain_logprobs`); NaN on every other row. A chain of several
  teacher tokens whose first one has a student twin listed in the row is not served
  (the row counts as ``BOUNDARY``): its event lies inside that entry's, so the two
  masses could add up past 1 in the loss's ``"tail_actual"`` mode
  (docs/cross_tokenizer.md, "tail_actual");
- a ``MASKED`` row (the prefix ends inside a teacher token): no distribution. Its
  log-probs are all NaN (ids ``0..K-1``, distinct and in range), which the losses read as
  "this row does not count" and which no reader can take for a distribution.

Pure numpy; :func:`teacher_span` says which teacher rows to ask the engine for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from teacher_server.alignment.boundaries import Alignment, RowKind
from teacher_server.alignment.chain import chain_logprobs
from teacher_server.alignment.vocab_map import UNMAPPED, VocabMap, project_topk

__all__ = ["StudentRows", "student_rows", "teacher_candidates", "teacher_span"]


@dataclass(frozen=True, eq=False)
class StudentRows:
    """Student rows ``[start, start + S)`` of one sequence.

    Attributes:
        ids: ``[S, K]`` int32 student ids, each row sorted by log-prob (``0..K-1`` on a
            masked row).
        logprobs: ``[S, K]`` float32, descending; ``-inf`` on padding columns, NaN on
            every column of a masked row.
        sampled_logprobs: ``[S]`` float32: the chain-rule log-prob of the next student
            token on ``ALIGNED`` rows, NaN elsewhere.
        kinds: ``[S]`` int8 :class:`~.boundaries.RowKind` values.
    """

    ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    sampled_logprobs: npt.NDArray[np.float32]
    kinds: npt.NDArray[np.int8]


def teacher_span(alignment: Alignment, start: int, end: int) -> tuple[int, int]:
    """The teacher rows ``[ts, te)`` that student rows ``[start, end)`` read: the rows of
    their boundary rows and every row of their chains (``(0, 0)``: none, every row is
    masked)."""
    rows = alignment.teacher_row[start:end]
    read = rows[rows >= 0]
    if read.size == 0:
        return 0, 0
    stops = alignment.chain_stop[start:end]
    last = max(int(read.max()) + 1, int(stops.max()))
    return int(read.min()), last


def teacher_candidates(
    alignment: Alignment,
    start: int,
    end: int,
    student_candidates: npt.NDArray[np.integer],
    student_to_teacher: npt.NDArray[np.integer],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """Student rows ``[start, end)``'s candidate ids (``[S, C]`` student ids, ``-1``
    padding) as the teacher rows they read ask for them: ``([te - ts, C]`` teacher ids,
    ``-1`` where no boundary row reads the teacher row or the column pads, ``[S]`` each
    student row's index into it or -1 for a masked row). ``(ts, te)`` is
    :func:`teacher_span`'s.

    Raises:
        ValueError: a candidate whose bytes are not exactly one teacher token (no teacher
            row holds its log-prob), naming its ``[row][column]`` and id; or two student
            rows that read one teacher row with different candidates.
    """
    cand = np.asarray(student_candidates, dtype=np.int64)
    ts, te = teacher_span(alignment, start, end)
    mapped = np.where(cand >= 0, np.asarray(student_to_teacher)[np.clip(cand, 0, None)], -1)
    missing = np.argwhere((cand >= 0) & (mapped < 0))
    if missing.size:
        r, c = (int(v) for v in missing[0])
        raise ValueError(
            f"[{r}][{c}]: student id {int(cand[r, c])} is not one teacher token (the teacher "
            "spells its bytes with several tokens, or has no token of them), so no teacher "
            f"row holds its log-prob ({len(missing)} such in all)"
        )
    rows = alignment.teacher_row[start:end]
    index = np.where(rows >= 0, rows - ts, -1)
    out = np.full((max(te - ts, 0), cand.shape[1]), -1, dtype=np.int32)
    read = index >= 0
    out[index[read]] = mapped[read]
    if not np.array_equal(out[index[read]], mapped[read]):
        raise ValueError("two student rows read one teacher row with different candidate ids")
    return out, index


def student_rows(
    alignment: Alignment,
    start: int,
    end: int,
    teacher: tuple[npt.NDArray[np.integer], npt.NDArray[np.floating], npt.NDArray[np.floating]],
    teacher_start: int,
    vocab_map: VocabMap,
    teacher_tokens: npt.NDArray[np.integer],
) -> StudentRows:
    """Student rows ``[start, end)`` from the teacher's rows ``[teacher_start, ...)``.

    Args:
        alignment: the sequence's alignment (``Ls`` student rows, ``Lt`` teacher rows).
        start, end: the student rows asked for, ``0 <= start <= end <= Ls``.
        teacher: ``(ids [R, K], logprobs [R, K], sampled_logprobs [R])``: teacher rows
            ``[teacher_start, teacher_start + R)``, which must hold
            :func:`teacher_span` of ``[start, end)``.
        teacher_start: the teacher row of ``teacher``'s row 0.
        vocab_map: the teacher -> student id map.
        teacher_tokens: ``[Lt]`` the teacher's token ids (a chain's first token).

    Returns:
        The :class:`StudentRows` (``S = end - start``, ``K`` the teacher rows' width).

    Example::

        >>> import numpy as np
        >>> from teacher_server.alignment import align_lengths
        >>> from teacher_server.alignment.vocab_map import VocabMap
        >>> a = align_lengths([1, 3, 1, 1, 1], [1, 1, 1, 1, 3])  # the module doc's
        >>> vmap = VocabMap(np.arange(10, dtype=np.int32), 10)  # ids map to themselves
        >>> ids = np.array([[1, 2]] * 5)
        >>> lps = np.log(np.array([[0.5, 0.25]] * 5))
        >>> sampled = np.log(np.array([0.5, 0.5, 0.5, 0.25, np.nan]))
        >>> rows = student_rows(a, 0, 5, (ids, lps, sampled), 0, vmap, np.arange(5) + 5)
        >>> rows.kinds.tolist(), round(float(np.exp(rows.sampled_logprobs[0])), 3)
        ([2, 1, 0, 0, 1], 0.125)
        >>> bool(np.isnan(rows.logprobs[2]).all())
        True
    """
    t_ids, t_lps, t_sampled = (np.asarray(a) for a in teacher)
    lt = alignment.teacher_ends.shape[0]
    ts, te = teacher_span(alignment, start, end)
    have = range(teacher_start, teacher_start + t_ids.shape[0])
    if ts < te and (ts < have.start or te > have.stop):
        raise ValueError(
            f"teacher: rows [{have.start}, {have.stop}) do not hold the rows [{ts}, {te}) "
            f"that student rows [{start}, {end}) read"
        )
    k = t_ids.shape[1]
    kinds = alignment.kind[start:end].copy()
    s = end - start
    ids = np.broadcast_to(np.arange(k, dtype=np.int32), (s, k)).copy()
    lps = np.full((s, k), np.nan, dtype=np.float32)
    known = kinds >= RowKind.BOUNDARY
    if known.any():
        rows = alignment.teacher_row[start:end][known] - teacher_start
        ids[known], lps[known] = project_topk(t_ids[rows], t_lps[rows], vocab_map)
    full = np.full(lt, np.nan, dtype=np.float64)  # the teacher's sampled log-probs by row
    full[have.start : min(have.stop, lt)] = t_sampled[: max(min(have.stop, lt) - have.start, 0)]
    chain = chain_logprobs(alignment, full)[start:end]
    overlap = _overlapping_chains(alignment, start, end, ids, lps, vocab_map, teacher_tokens)
    chain[overlap] = np.nan
    kinds[overlap] = RowKind.BOUNDARY
    return StudentRows(ids, lps, chain.astype(np.float32), kinds)


def _overlapping_chains(
    alignment: Alignment,
    start: int,
    end: int,
    ids: npt.NDArray[np.int32],
    lps: npt.NDArray[np.float32],
    vocab_map: VocabMap,
    teacher_tokens: npt.NDArray[np.integer],
) -> npt.NDArray[np.bool_]:
    """``[S]``: ``ALIGNED`` rows whose chain spans several teacher tokens, the first of
    which has a student twin listed (finite log-prob) in the row ``ids`` / ``lps``."""
    rows = alignment.teacher_row[start:end]
    stop = alignment.chain_stop[start:end]
    long = (alignment.kind[start:end] == RowKind.ALIGNED) & (stop - rows >= 2)
    if not long.any():
        return long
    tokens = np.asarray(teacher_tokens, dtype=np.int64)
    first = np.where(long, tokens[np.clip(rows + 1, 0, len(tokens) - 1)], 0)
    twin = vocab_map.teacher_to_student[first]
    listed = ((ids == twin[:, None]) & np.isfinite(lps)).any(axis=1)
    return long & (twin != UNMAPPED) & listed
