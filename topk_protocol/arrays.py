"""``SequenceArrays``: one sequence's payload rows, the one type every layer hands on.

The teacher's backends return it, the codec encodes and decodes it, a recording writes
and reads it, replay and the payload dataset serve it. Row ``j`` is position
``position_start + j``; every array field is either ``[S, K]`` (a column per top-k entry,
cut by :meth:`SequenceArrays.top`) or ``[S]`` (one value per row). The methods that cut,
join and build arrays go over the fields generically (:data:`ARRAY_FIELDS`), so a new
per-row field is declared here once and carried through every slice, join and empty
answer without further code. A new field goes after ``position_start``, with a default
(None for an optional one), so that positional construction keeps its meaning.

The wire fields (:data:`WIRE_FIELDS`) are the ones the codec encodes and a recording
writes. A field declared ``wire=False`` lives only inside the teacher server, between a
backend and the front end that renders it (``sampled_ranks``, for the HTTP routes that
report vLLM's ``rank``; ``row_kinds``, for the counts of a cross-tokenizer answer): it is
cut and joined with the rest, but never sent or recorded.

Candidate fields (``candidate_ids`` / ``candidate_logprobs``, ``[S, C]``) are the teacher's
log-probs at ids the request named for each row: a column per candidate, not cut by
:meth:`SequenceArrays.top`, both present or both absent.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["ARRAY_FIELDS", "WIRE_FIELDS", "ArrayField", "SequenceArrays"]


@dataclass(frozen=True)
class ArrayField:
    """How one array field of :class:`SequenceArrays` is shaped: ``columns`` True for
    ``[S, K]``, False for ``[S]``; ``candidates`` True for ``[S, C]`` (a column per
    candidate id); ``dtype`` its numpy dtype; ``optional``: may be None; ``wire``: encoded
    and recorded (False: the teacher server's own, see the module docstring)."""

    name: str
    dtype: type[np.generic]
    columns: bool
    optional: bool
    candidates: bool = False
    wire: bool = True

    @property
    def width(self) -> str:
        """The name of its column count: ``"K"``, ``"C"`` or ``""`` (``[S]``)."""
        return "K" if self.columns else "C" if self.candidates else ""

    def shape(self, rows: int, top_k: int, num_candidates: int) -> tuple[int, ...]:
        """Its shape for ``rows`` rows of ``top_k`` columns and ``num_candidates``."""
        if self.columns:
            return (rows, top_k)
        return (rows, num_candidates) if self.candidates else (rows,)


def _array(
    dtype: type[np.generic],
    columns: bool,
    optional: bool = False,
    candidates: bool = False,
    wire: bool = True,
) -> dict[str, Any]:
    """The metadata of a dataclass field holding an array of :class:`SequenceArrays`."""
    return {"array": (dtype, columns, optional, candidates, wire)}


@dataclass(frozen=True, eq=False)
class SequenceArrays:
    """Top-k payload of positions ``[position_start, position_start + S)`` of one sequence.

    Attributes:
        ids: ``[S, K]`` int32 token ids, each row sorted by log-prob, descending.
        logprobs: ``[S, K]`` float32 log-probs (float16 / bfloat16 values widened exactly).
        sampled_logprobs: ``[S]`` float32, log p(x[t+1] | x[..t]), NaN at the last
            position of the sequence; None when not computed or not asked for.
        position_start: the absolute position of row 0 (>= 0).
        candidate_ids: ``[S, C]`` int32 ids the request named for each row, ``-1``
            padding; None without candidates.
        candidate_logprobs: ``[S, C]`` float32, the teacher's log-prob at each candidate
            id (same log-softmax as ``logprobs``), NaN where the id is ``-1``; present
            exactly when ``candidate_ids`` is.
        sample_counts: sampled payloads only: ``[S, K]`` uint8, how often each column's id
            was drawn (0: a padding column; a row sums to N); then ``ids`` holds each
            row's distinct drawn ids (ascending, padding 0) and ``logprobs`` the teacher's
            log-probs at them (padding 0), and rows are not sorted by log-prob.
        proposal_log_normalizer: sampled from a tempered proposal only: ``[S]`` float32,
            ``log Z`` of ``q = p^(1/tau) / Z``.
        sampled_ranks: ``[S]`` int32, the rank of ``x[t+1]`` in the teacher's
            distribution, ``1 + #{v : logprob(v) > logprob(x[t+1])}`` as vLLM counts it
            (entries equal to it count too), 0 at the last position of the sequence;
            None where the backend does not know it (a replayed recording). Not a wire
            field: the teacher's HTTP routes report it, the codec and recordings skip it.
        row_kinds: a student tokenizer's answer only: ``[S]`` int8, each row's kind
            (``teacher_server.alignment.RowKind``: 0 masked, 1 boundary, 2 aligned). Not
            a wire field: the answer reports the counts, the rows carry the mask.

    Arrays are converted to their dtypes when built (no copy when they already have
    them) and their shapes checked here, once: a bad one raises ``ValueError`` naming the
    field. Arrays may be read-only views (of a wire buffer or a memory-mapped recording);
    treat them as immutable. Compared by identity (``==`` on arrays is element-wise).
    """

    ids: npt.NDArray[np.int32] = field(metadata=_array(np.int32, columns=True))
    logprobs: npt.NDArray[np.float32] = field(metadata=_array(np.float32, columns=True))
    sampled_logprobs: npt.NDArray[np.float32] | None = field(
        default=None, metadata=_array(np.float32, columns=False, optional=True)
    )
    position_start: int = 0
    candidate_ids: npt.NDArray[np.int32] | None = field(
        default=None, metadata=_array(np.int32, columns=False, optional=True, candidates=True)
    )
    candidate_logprobs: npt.NDArray[np.float32] | None = field(
        default=None, metadata=_array(np.float32, columns=False, optional=True, candidates=True)
    )
    sample_counts: npt.NDArray[np.uint8] | None = field(
        default=None, metadata=_array(np.uint8, columns=True, optional=True)
    )
    proposal_log_normalizer: npt.NDArray[np.float32] | None = field(
        default=None, metadata=_array(np.float32, columns=False, optional=True)
    )
    sampled_ranks: npt.NDArray[np.int32] | None = field(
        default=None, metadata=_array(np.int32, columns=False, optional=True, wire=False)
    )
    row_kinds: npt.NDArray[np.int8] | None = field(
        default=None, metadata=_array(np.int8, columns=False, optional=True, wire=False)
    )

    def __post_init__(self) -> None:
        try:
            start = operator.index(self.position_start)
        except TypeError:
            raise ValueError(
                f"position_start: expected an int, got {type(self.position_start).__name__}"
            ) from None
        if start < 0:
            raise ValueError(f"position_start: must be >= 0, got {start}")
        object.__setattr__(self, "position_start", start)
        ids = np.asarray(self.ids, dtype=np.int32)
        if ids.ndim != 2:
            raise ValueError(f"ids: expected [S, K], got shape {ids.shape}")
        if (self.candidate_ids is None) != (self.candidate_logprobs is None):
            raise ValueError("candidate_ids, candidate_logprobs: give both or neither")
        cand = None if self.candidate_ids is None else np.shape(self.candidate_ids)
        c = cand[1] if cand is not None and len(cand) == 2 else 0
        for f in ARRAY_FIELDS:
            value = getattr(self, f.name)
            if value is None:
                if not f.optional:
                    raise ValueError(f"{f.name}: required, got None")
                continue
            arr = np.asarray(value, dtype=f.dtype)
            want = f.shape(ids.shape[0], ids.shape[1], c)
            if arr.shape != want:
                shape = f"[{', '.join(['S', f.width] if f.width else ['S'])}]"
                raise ValueError(
                    f"{f.name}: expected shape {shape} = {want} (S from ids), got {arr.shape}"
                )
            object.__setattr__(self, f.name, arr)

    # -- shape ------------------------------------------------------------------------
    @property
    def num_positions(self) -> int:
        """``S``: rows (positions)."""
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        """``K``: columns."""
        return int(self.ids.shape[1])

    @property
    def num_candidates(self) -> int:
        """``C``: candidate columns (0 without candidates)."""
        return 0 if self.candidate_ids is None else int(self.candidate_ids.shape[1])

    @property
    def position_end(self) -> int:
        """The position after the last row (``position_start + S``)."""
        return self.position_start + self.num_positions

    def __len__(self) -> int:
        return self.num_positions

    def __repr__(self) -> str:
        present = [f.name for f in ARRAY_FIELDS if getattr(self, f.name) is not None]
        return (
            f"SequenceArrays(positions=[{self.position_start}, {self.position_end}), "
            f"top_k={self.top_k}, num_candidates={self.num_candidates}, fields={present})"
        )

    # -- cut, join, build -------------------------------------------------------------
    def rows(self, start: int, stop: int) -> SequenceArrays:
        """Rows ``[start, stop)`` (relative to row 0; views, no copy), ``position_start``
        moved with them. Raises ``ValueError`` unless ``0 <= start <= stop <= S``."""
        if not 0 <= start <= stop <= self.num_positions:
            raise ValueError(f"rows: [{start}, {stop}) is not inside [0, {self.num_positions})")
        return self._map(lambda a, _: a[start:stop], self.position_start + start)

    def positions(self, start: int, end: int) -> SequenceArrays:
        """The rows of absolute positions ``[start, end)``, which must lie inside
        ``[position_start, position_end)`` (``ValueError`` otherwise)."""
        if not self.position_start <= start <= end <= self.position_end:
            raise ValueError(
                f"positions: [{start}, {end}) is not inside the rows' "
                f"[{self.position_start}, {self.position_end})"
            )
        return self.rows(start - self.position_start, end - self.position_start)

    def top(self, k: int) -> SequenceArrays:
        """The first ``k`` columns of every ``[S, K]`` field (rows are sorted, so this is
        the top-k; views, no copy). Raises ``ValueError`` unless ``1 <= k <= K``."""
        if not 1 <= k <= self.top_k:
            raise ValueError(f"top_k: {k} is not in [1, {self.top_k}]")
        if k == self.top_k:
            return self
        return self._map(lambda a, f: a[:, :k] if f.columns else a, self.position_start)

    def copy(self) -> SequenceArrays:
        """The same rows in arrays of their own (not views of a larger buffer)."""
        return self._map(lambda a, _: a.copy(), self.position_start)

    @property
    def nbytes(self) -> int:
        """Bytes of the present array fields."""
        return sum(
            getattr(self, f.name).nbytes for f in ARRAY_FIELDS if getattr(self, f.name) is not None
        )

    def _map(self, fn: Any, position_start: int) -> SequenceArrays:
        """Apply ``fn(array, field)`` to every present array field."""
        changed = {
            f.name: fn(getattr(self, f.name), f)
            for f in ARRAY_FIELDS
            if getattr(self, f.name) is not None
        }
        return replace(self, position_start=position_start, **changed)

    @classmethod
    def concat(cls, parts: Sequence[SequenceArrays]) -> SequenceArrays:
        """Join consecutive row chunks of one sequence, in order (e.g. a streamed answer).

        Each part must start where the one before ends and have the same K (and C when
        it has candidates); an optional field is kept only when every part has it.
        ``ValueError`` names what differs.
        """
        if not parts:
            raise ValueError("parts: need at least one chunk")
        first = parts[0]
        for i, (a, b) in enumerate(pairwise(parts), start=1):
            if b.position_start != a.position_end:
                raise ValueError(
                    f"parts[{i}]: starts at position {b.position_start}, the part before "
                    f"ends at {a.position_end}"
                )
            if b.top_k != first.top_k:
                raise ValueError(f"parts[{i}]: top_k {b.top_k}, parts[0] has {first.top_k}")
            both = b.candidate_ids is not None and first.candidate_ids is not None
            if both and b.num_candidates != first.num_candidates:
                raise ValueError(
                    f"parts[{i}]: num_candidates {b.num_candidates}, parts[0] has "
                    f"{first.num_candidates}"
                )
        if len(parts) == 1:
            return first
        joined: dict[str, Any] = {}
        for f in ARRAY_FIELDS:
            arrays = [getattr(p, f.name) for p in parts]
            joined[f.name] = None if any(a is None for a in arrays) else np.concatenate(arrays)
        return cls(**joined, position_start=first.position_start)

    @classmethod
    def empty(
        cls, top_k: int, position_start: int = 0, num_candidates: int | None = None
    ) -> SequenceArrays:
        """No rows (``S = 0``), every field present (the candidate fields with
        ``num_candidates`` columns; None: absent): the answer to an empty range."""
        return cls(
            **{
                f.name: np.zeros(f.shape(0, top_k, num_candidates or 0), f.dtype)
                for f in ARRAY_FIELDS
                if not f.candidates or num_candidates is not None
            },
            position_start=position_start,
        )


#: The array fields of :class:`SequenceArrays`, in declaration order.
ARRAY_FIELDS: Final[tuple[ArrayField, ...]] = tuple(
    ArrayField(f.name, *f.metadata["array"])
    for f in fields(SequenceArrays)
    if "array" in f.metadata
)

#: The fields the codec encodes and a recording writes, in declaration order.
WIRE_FIELDS: Final[tuple[ArrayField, ...]] = tuple(f for f in ARRAY_FIELDS if f.wire)
