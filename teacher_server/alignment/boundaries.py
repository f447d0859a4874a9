"""Which student rows a teacher of another tokenizer answers, found by byte offsets.

**Rows.** As everywhere in the protocol, row ``t`` of a sequence ``x`` is the
distribution of the next token ``x[t+1]`` given the prefix ``x[:t+1] = x[0..t]``. Here
the student's tokens ``x[0..Ls)`` and the teacher's tokens ``y[0..Lt)`` stand for the
same bytes; token ``t`` ends at byte ``end[t]`` (the cumulative sum of the byte lengths,
so token ``t`` covers ``[end[t] - len[t], end[t])``). Student row ``t`` is the
distribution at byte prefix ``end_x[t]``; teacher row ``j`` the one at ``end_y[j]``.

**Kinds** of student row ``t`` (:class:`RowKind`):

- ``BOUNDARY``: the student prefix ends where a teacher token ends, ``end_x[t] ==
  end_y[j]``. Teacher row ``j`` (:attr:`Alignment.teacher_row`) is the teacher's next-token
  distribution at that very prefix: the student's row ``t`` reads it.
- ``ALIGNED``: a boundary whose next student token also ends on a teacher boundary,
  ``end_x[t+1] == end_y[j']``. That token's bytes are exactly the teacher tokens
  ``y[j+1..j']``, so ``log p(x[t+1] | x[..t]) = sum_{i=j}^{j'-1} log p(y[i+1] | y[..i])``:
  the teacher's actual-token log-probs of rows ``j..j'-1`` (:mod:`.chain`).
- ``MASKED``: the student prefix ends inside a teacher token (or where no teacher row
  is, before the teacher's first token or past its last): no teacher row holds the
  distribution there.

Example (``|`` marks token ends; both spell ``b"abcdefg"``)::

    student  a | bcd | e | f | g |     ends [1, 4, 5, 6, 7]
    teacher  a | b | c | d | efg |     ends [1, 2, 3, 4, 7]
    row t        0        1         2       3       4
    kind         ALIGNED  BOUNDARY  MASKED  MASKED  BOUNDARY
    teacher_row  0        3         -1      -1      4

Row 0 (prefix ``a``) is teacher row 0, and its next token ``bcd`` is the teacher's
``b, c, d``: ``log p(bcd | a) = log p(b | a) + log p(c | ab) + log p(d | abc)``, teacher
rows 0..2. Row 1 (prefix ``abcd``) is teacher row 3, but its next token ``e`` ends inside
``efg``: the row has the teacher's distribution, its actual token no chain. Rows 2 and 3
end inside ``efg`` (one teacher token spanning three student tokens). Row 4, the last,
is the teacher's last row (the distribution after the whole text).

**Offsets.** The student's bytes may start ``student_offset`` bytes into the teacher's
(the teacher read a prefix first, or its tokenizer prepends a space): student ends are
then counted from the teacher's byte 0. The teacher may also cover more or fewer bytes
than the student; rows past the teacher's last byte are ``MASKED``.

**Empty tokens.** A token of zero bytes (a BOS the caller gives length 0) ends where the
token before it ends. A student prefix that ends where several teacher tokens end reads
the last of them (the teacher's prefix with every empty token up to that byte: after the
teacher's BOS), and a zero-byte next student token is never ``ALIGNED`` (it has no
teacher tokens of its own).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from teacher_server.alignment.token_bytes import TokenBytes

__all__ = ["Alignment", "RowKind", "align_lengths", "align_tokens"]


class RowKind(enum.IntEnum):
    """What a student row is to the teacher (module doc)."""

    MASKED = 0
    BOUNDARY = 1
    ALIGNED = 2


@dataclass(frozen=True, eq=False)
class Alignment:
    """The student rows of one sequence against the teacher's.

    Attributes:
        student_ends: ``[Ls]`` int64: the byte (teacher's byte 0 = 0) where student token
            ``t`` ends; row ``t`` is the distribution at that byte prefix.
        teacher_ends: ``[Lt]`` int64: the byte where teacher token ``j`` ends.
        teacher_row: ``[Ls]`` int64: the teacher row whose next-token distribution is
            student row ``t``'s, -1 where ``MASKED``.
        kind: ``[Ls]`` int8 :class:`RowKind` values.
    """

    student_ends: npt.NDArray[np.int64]
    teacher_ends: npt.NDArray[np.int64]
    teacher_row: npt.NDArray[np.int64]
    kind: npt.NDArray[np.int8]

    @property
    def boundary(self) -> npt.NDArray[np.bool_]:
        """``[Ls]``: rows with a teacher row (``BOUNDARY`` or ``ALIGNED``)."""
        return self.kind >= RowKind.BOUNDARY

    @property
    def aligned(self) -> npt.NDArray[np.bool_]:
        """``[Ls]``: rows whose next student token has a chain-rule log-prob."""
        return self.kind == RowKind.ALIGNED

    @property
    def chain_stop(self) -> npt.NDArray[np.int64]:
        """``[Ls]``: for an ``ALIGNED`` row ``t``, ``j' = teacher_row[t+1]`` (the teacher
        rows ``[teacher_row[t], j')`` hold the next token's chain); -1 elsewhere."""
        stop = np.full_like(self.teacher_row, -1)
        stop[:-1] = np.where(self.aligned[:-1], self.teacher_row[1:], -1)
        return stop


def align_lengths(
    student_lengths: npt.ArrayLike, teacher_lengths: npt.ArrayLike, *, student_offset: int = 0
) -> Alignment:
    """Align two tokenizations of the same bytes from their tokens' byte lengths.

    Args:
        student_lengths: ``[Ls]`` ints >= 0, the bytes of each student token.
        teacher_lengths: ``[Lt]`` ints >= 0, the bytes of each teacher token.
        student_offset: where the student's byte 0 lies in the teacher's bytes (>= 0).

    Returns:
        The :class:`Alignment`.

    Example::

        >>> a = align_lengths([1, 3, 1, 1, 1], [1, 1, 1, 1, 3])  # the module doc's
        >>> a.kind.tolist(), a.teacher_row.tolist(), a.chain_stop.tolist()
        ([2, 1, 0, 0, 1], [0, 3, -1, -1, 4], [3, -1, -1, -1, -1])
    """
    s_len = _lengths("student_lengths", student_lengths)
    t_len = _lengths("teacher_lengths", teacher_lengths)
    if student_offset < 0:
        raise ValueError(f"student_offset: must be >= 0, got {student_offset}")
    s_end = np.cumsum(s_len) + np.int64(student_offset)
    t_end = np.cumsum(t_len)
    # the last teacher token ending at or before each student end
    last = np.searchsorted(t_end, s_end, side="right") - 1
    hit = (last >= 0) & (t_end[np.clip(last, 0, None)] == s_end) if t_end.size else last >= 0
    teacher_row = np.where(hit, last, -1).astype(np.int64)
    kind = np.where(hit, RowKind.BOUNDARY, RowKind.MASKED).astype(np.int8)
    if s_len.size > 1:
        nxt = hit[:-1] & hit[1:] & (s_len[1:] > 0)
        kind[:-1][nxt] = RowKind.ALIGNED
    return Alignment(s_end, t_end, teacher_row, kind)


def align_tokens(
    student_ids: npt.ArrayLike,
    teacher_ids: npt.ArrayLike,
    student: TokenBytes,
    teacher: TokenBytes,
    *,
    student_offset: int = 0,
) -> Alignment:
    """Align a student and a teacher token sequence, checking that they spell the same bytes.

    Args:
        student_ids: ``[Ls]`` student token ids.
        teacher_ids: ``[Lt]`` teacher token ids.
        student: the student tokenizer's :class:`TokenBytes`.
        teacher: the teacher tokenizer's.
        student_offset: where the student's bytes start in the teacher's.

    Returns:
        :func:`align_lengths` of the two sequences' byte lengths.

    Raises:
        ValueError: an id outside its table, or the student's bytes are not the teacher's
            bytes ``[student_offset, student_offset + len)``.
    """
    s_ids = student.checked_ids(student_ids)
    t_ids = teacher.checked_ids(teacher_ids)
    s_bytes = student.join(s_ids)
    t_bytes = teacher.join(t_ids)
    if t_bytes[student_offset : student_offset + len(s_bytes)] != s_bytes:
        raise ValueError(
            f"the student's {len(s_bytes)} bytes are not the teacher's bytes from offset "
            f"{student_offset} (the teacher's tokens spell {len(t_bytes)} bytes)"
        )
    return align_lengths(
        student.lengths[s_ids], teacher.lengths[t_ids], student_offset=student_offset
    )


def _lengths(name: str, values: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``values`` as ``[L]`` int64 byte lengths; ``ValueError`` unless 1-D, integer, >= 0."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name}: expected [L] integers, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name}: byte lengths must be >= 0")
    return arr
