"""Routing a batch over named teachers: split by teacher, put the answers back in order.

Pure functions (inputs in, tensors out), shared by the live multi-teacher client
(:mod:`student_client.clients.multi_teacher`) and by
:class:`~student_client.offline.replay_client.ReplayClient`
on a multi-teacher recording:

- :func:`teacher_per_row` reads the ``teacher`` of a batch (a name per sequence, one name
  for all, or indices into the teacher names) and checks every name;
- :func:`plan_routes` splits a :class:`~student_client.clients.aio.ScoreBatch` into one
  sub-batch per teacher (sequences, positions and attention-mask rows of that teacher,
  in input order);
- :func:`merge_payloads` puts the teachers' payloads back into one ``[B, S, K]`` payload in
  input order, padded like a single teacher's answer, with ``teachers`` naming the
  teacher of each row;
- :func:`check_agreement` refuses teachers whose vocabulary, tokenizer or temperature
  differ (one student, one vocabulary, one loss temperature).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from student_client.data.alignment import unpack_inputs
from student_client.data.batch import ScoreBatch
from student_client.data.padding import PayloadBuffers, present_fields
from student_client.data.payload import TeacherPayload
from topk_protocol import TeacherInfo
from topk_protocol.errors import (
    InvalidRequestError,
    TeacherError,
    TeacherMismatchError,
    VocabMismatchError,
)

__all__ = [
    "Route",
    "batch_rows",
    "check_agreement",
    "merge_payloads",
    "name_error",
    "plan_routes",
    "teacher_per_row",
]


@dataclass(frozen=True)
class Route:
    """One teacher's part of a batch: ``rows`` (indices into the batch, ascending) and
    the sub-batch of those rows."""

    teacher: str
    rows: list[int]
    batch: ScoreBatch


def batch_rows(sequences: Any) -> int:
    """``B`` of a batch (``[B, L]`` tensor / array, or a list of sequences)."""
    if isinstance(sequences, Mapping):
        sequences = sequences.get("input_ids", ())
    if isinstance(sequences, torch.Tensor | np.ndarray):
        return int(sequences.shape[0]) if sequences.ndim >= 1 else 0
    try:
        return len(sequences)
    except TypeError:
        raise InvalidRequestError(
            f"sequences: expected a batch of token sequences, got {type(sequences).__name__}"
        ) from None


def teacher_per_row(teacher: Any, batch_size: int, names: Sequence[str]) -> list[str]:
    """The teacher name of each of ``batch_size`` rows.

    ``teacher`` is a name (every row), a sequence of names or of indices into ``names``
    (a ``[B]`` int tensor included), or None (allowed only with a single teacher).
    Raises :class:`InvalidRequestError` naming ``teacher[i]`` and the known names.
    """
    known = list(names)
    if teacher is None:
        if len(known) == 1:
            return known * batch_size
        raise InvalidRequestError(
            f"teacher: missing; with teachers {known} every sequence needs one "
            "(score(..., teacher=[...]) or ScoreBatch(..., teacher=[...]))"
        )
    if isinstance(teacher, str):
        teacher = [teacher] * batch_size
    elif isinstance(teacher, torch.Tensor | np.ndarray):
        teacher = teacher.reshape(-1).tolist()
    values = list(teacher)
    if len(values) != batch_size:
        raise InvalidRequestError(f"teacher: {len(values)} names for {batch_size} sequences")
    out: list[str] = []
    for i, value in enumerate(values):
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            if not 0 <= int(value) < len(known):
                raise InvalidRequestError(
                    f"teacher[{i}]: index {int(value)} is outside [0, {len(known)}) ({known})"
                )
            value = known[int(value)]
        if value not in known:
            raise InvalidRequestError(f"teacher[{i}]: {value!r} is not one of {known}")
        out.append(str(value))
    return out


def _take(value: Any, rows: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(rows, dtype=torch.long, device=value.device)]
    if isinstance(value, np.ndarray):
        return value[rows]
    items = list(value)
    return [items[i] for i in rows]


def _all_padding(mask: Any) -> bool:
    arr = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    return bool(arr.size) and not bool(np.asarray(arr, dtype=np.float64).any())


def plan_routes(item: ScoreBatch, names: Sequence[str]) -> tuple[list[str], list[Route]]:
    """Split a batch by teacher: ``(teacher of each row, one Route per teacher present)``
    in order of first appearance. A teacher whose rows are all padding (attention mask 0)
    gets no route: those rows come back empty, as from a single teacher."""
    seqs, mask = unpack_inputs(item.sequences, item.attention_mask)
    b = batch_rows(seqs)
    teachers = teacher_per_row(item.teacher, b, names)
    if item.positions is not None and len(item.positions) != b:
        raise InvalidRequestError(f"positions: {len(item.positions)} (start, end) pairs for {b}")
    by_teacher: dict[str, list[int]] = {}
    for i, name in enumerate(teachers):
        by_teacher.setdefault(name, []).append(i)
    routes = []
    for name, rows in by_teacher.items():
        sub_mask = None if mask is None else _take(mask, rows)
        if sub_mask is not None and len(by_teacher) > 1 and _all_padding(sub_mask):
            continue
        split = len(by_teacher) > 1
        cands = item.candidate_ids
        sub = ScoreBatch(
            _take(seqs, rows) if split else seqs,
            None if item.positions is None else _take(item.positions, rows),
            sub_mask if split else mask,
            candidate_ids=None if cands is None else (_take(cands, rows) if split else cands),
        )
        routes.append(Route(name, rows, sub))
    if not routes:
        raise InvalidRequestError("attention_mask: every row is padding; nothing to score")
    return teachers, routes


def merge_payloads(
    parts: Sequence[tuple[Sequence[int], TeacherPayload]], teachers: Sequence[str]
) -> TeacherPayload:
    """The payloads of a batch's routes, back in input order.

    Args:
        parts: ``(rows, payload)`` per route: ``payload`` is ``[b_i, S_i, K]``, row ``j``
            of it is batch row ``rows[j]``.
        teachers: the teacher of each of the ``B`` batch rows.

    Returns:
        ``[B, S, K]`` with ``S = max S_i``; rows no route holds and the padding are ids 0,
        log-probs 0, sampled 0, ``mask`` False (the single-teacher padding), so each row
        equals its teacher's answer for the same rows asked directly; ``teachers`` set.
    """
    if not parts:
        raise ValueError("parts: empty")
    first = parts[0][1]
    s = max(int(p.ids.shape[1]) for _, p in parts)
    out = PayloadBuffers.like([p for _, p in parts], len(teachers), s, first.top_k)
    starts = torch.zeros(len(teachers), dtype=torch.int64)
    lengths = torch.zeros(len(teachers), dtype=torch.int64)
    for rows, p in parts:
        if p.top_k != first.top_k or p.dtype != first.dtype:
            raise ValueError("parts: payloads of different K or dtype")
        idx = torch.tensor(list(rows), dtype=torch.long)
        p = p.to("cpu")
        out.put((idx, slice(0, int(p.ids.shape[1]))), present_fields(p))
        starts[idx] = p.position_start
        lengths[idx] = p.lengths
    return out.payload(
        position_start=starts,
        lengths=lengths,
        top_k=first.top_k,
        dtype=first.dtype,
        request_id=",".join(p.request_id for _, p in parts),
        teacher_seconds=sum(p.teacher_seconds for _, p in parts),
        teachers=tuple(teachers),
        proposal_temperature=first.proposal_temperature,
    )


def check_agreement(infos: Mapping[str, TeacherInfo], targets: Mapping[str, Any]) -> None:
    """Refuse teachers that one student cannot learn from together.

    Every teacher must announce the vocabulary size and tokenizer fingerprint of the
    first one (:class:`VocabMismatchError`), and the same temperature
    (:class:`TeacherMismatchError`): the loss tempers the student by one ``T`` per batch
    and scales its gradient by ``T**2``, so rows at different temperatures would weigh the
    domains differently and would need a per-row temperature through every loss (the
    fused one included); run such teachers through separate clients instead. The
    message names the teacher and its targets.
    """
    items = list(infos.items())
    ref_name, ref = items[0]
    for name, info in items[1:]:
        where = f"teacher {name!r} ({', '.join(map(str, targets[name]))})"
        problems = []
        if info.vocab_size != ref.vocab_size:
            problems.append(
                f"vocab_size: {info.vocab_size}, teacher {ref_name!r} has {ref.vocab_size}"
            )
        if info.tokenizer_fingerprint != ref.tokenizer_fingerprint:
            problems.append(
                f"tokenizer_fingerprint: {info.tokenizer_fingerprint!r}, teacher "
                f"{ref_name!r} has {ref.tokenizer_fingerprint!r}"
            )
        if problems:
            raise VocabMismatchError(f"{where}: " + "; ".join(problems))
        if info.teacher_temperature != ref.teacher_temperature:
            raise TeacherMismatchError(
                f"{where}: teacher_temperature: T = {info.teacher_temperature:g}, teacher "
                f"{ref_name!r} serves T = {ref.teacher_temperature:g}; a multi-teacher "
                "client needs one temperature (the loss tempers the student by one T)"
            )


def name_error(name: str, err: TeacherError) -> TeacherError:
    """``err`` with ``teacher 'name': `` in front of its message (same type and code; the
    name also in ``.teacher``), for a failure of one teacher's part of a batch."""
    message = f"teacher {name!r}: {err.message}"
    out = copy.copy(err)  # every attribute (code, path, ...) kept
    out.message = message
    out.args = (message,)
    out.teacher = name  # type: ignore[attr-defined]
    return out
