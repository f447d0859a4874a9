"""Hugging Face style inputs: padded batches in, payloads aligned to the padded batch out.

A tokenizer gives ``input_ids`` ``[B, T]`` with an ``attention_mask`` ``[B, T]`` (right or
left padding). The teacher must never score padding, and the student's logits are laid
out like the padded batch, so:

- :func:`unpad` cuts every row down to its real tokens and records where they sit
  (:class:`PaddedLayout`);
- the client scores the unpadded sequences (optionally only a sub-range of positions);
- :func:`place_rows` puts the payload rows back at their columns of the padded batch:
  ``[B, T, K]`` tensors whose ``mask`` is False on padding and on positions that were not
  scored. The same helper places response-only (sub-range) payloads of unpadded batches
  into the full ``[B, T, K]`` layout (:meth:`PaddedLayout.dense`), so a loss takes the
  student's full logits directly.

Everything here is pure (tensors in, tensors out); the clients build their requests
with :func:`build_aligned_request` and pass the answer through :func:`align`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from student_client.data.padding import PayloadBuffers, present_fields
from student_client.data.payload import TeacherPayload
from topk_protocol import RequestOptions, Span, build_request, pb
from topk_protocol.building import check_span
from topk_protocol.errors import InvalidRequestError

__all__ = [
    "PaddedLayout",
    "PreparedInputs",
    "align",
    "build_aligned_request",
    "place_rows",
    "prepare_inputs",
    "unpack_inputs",
    "unpad",
]


@dataclass(frozen=True)
class PaddedLayout:
    """Where the sequences sent to the teacher sit in a padded ``[B, T]`` batch.

    Attributes:
        rows: ``[N]`` int64: the batch row of each sent sequence (rows that hold no real
            token are not sent, so ``N <= B``).
        offsets: ``[N]`` int64: the column of each sent sequence's first token.
        batch_size: ``B``.
        total_len: ``T``.
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    batch_size: int
    total_len: int

    @classmethod
    def dense(cls, batch_size: int, total_len: int) -> PaddedLayout:
        """The layout of an unpadded batch: sequence ``b`` is row ``b`` from column 0
        (use it to place a sub-range payload into the full ``[B, T, K]`` layout)."""
        if batch_size < 1 or total_len < 1:
            raise ValueError(f"batch_size, total_len: must be >= 1, got {batch_size}, {total_len}")
        rows = torch.arange(batch_size, dtype=torch.int64)
        return cls(rows, torch.zeros(batch_size, dtype=torch.int64), batch_size, total_len)


@dataclass(frozen=True)
class PreparedInputs:
    """What to send for one batch: sequences, positions and candidate ids as the wire
    wants them, and the layout to place the answer into (None: the batch had no
    attention mask)."""

    sequences: Any
    positions: list[Span] | None
    layout: PaddedLayout | None
    candidate_ids: Any = None


def _as_2d(name: str, value: Any, is_mask: bool = False) -> npt.NDArray[np.int64]:
    """A ``[B, T]`` tensor / array / list of equal-length lists -> int64 array."""
    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged lists: numpy refuses to build a 2-D array
            arr = np.empty(0, dtype=object)
    if arr.ndim != 2 or arr.dtype == object:
        raise InvalidRequestError(
            f"{name}: expected a [B, T] batch (tensor, array or equal-length lists), got "
            f"{'ragged lists' if arr.dtype == object else f'shape {arr.shape}'}; "
            f"pad it (tokenizer(..., padding=True))"
        )
    if arr.dtype == np.bool_:
        arr = arr.astype(np.int64)
    if is_mask and np.issubdtype(arr.dtype, np.floating) and np.isin(arr, (0.0, 1.0)).all():
        arr = arr.astype(np.int64)  # a 0.0 / 1.0 float mask
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def unpad(input_ids: Any, attention_mask: Any) -> tuple[list[torch.Tensor], PaddedLayout]:
    """Cut a padded batch down to its real tokens.

    Args:
        input_ids: ``[B, T]`` token ids (tensor, array, or equal-length lists).
        attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding; in each row the real
            tokens must be one contiguous run (right padding, left padding, or both).

    Returns:
        ``(sequences, layout)``: the ``N`` non-empty rows' tokens as 1-D int64 tensors,
        and where they sit (:class:`PaddedLayout`).
    """
    ids = _as_2d("input_ids", input_ids)
    mask = _as_2d("attention_mask", attention_mask, is_mask=True)
    if mask.shape != ids.shape:
        raise InvalidRequestError(
            f"attention_mask: shape {list(mask.shape)} must equal input_ids' {list(ids.shape)}"
        )
    if ((mask != 0) & (mask != 1)).any():
        raise InvalidRequestError("attention_mask: must hold only 0 and 1")
    real = mask.astype(bool)
    counts = real.sum(axis=1)
    first = real.argmax(axis=1)
    # Contiguous iff the real tokens fill [first, first + count) exactly.
    cols = np.arange(ids.shape[1])
    span = (cols >= first[:, None]) & (cols < (first + counts)[:, None])
    bad = np.flatnonzero((span != real).any(axis=1))
    if bad.size:
        raise InvalidRequestError(
            f"attention_mask[{int(bad[0])}]: the real tokens are not one contiguous run "
            f"(only right or left padding is supported; split packed sequences first)"
        )
    rows = np.flatnonzero(counts > 0)
    if rows.size == 0:
        raise InvalidRequestError("attention_mask: every row is padding; nothing to score")
    sequences = [torch.from_numpy(ids[r, first[r] : first[r] + counts[r]].copy()) for r in rows]
    layout = PaddedLayout(
        rows=torch.from_numpy(rows.astype(np.int64)),
        offsets=torch.from_numpy(first[rows].astype(np.int64)),
        batch_size=int(ids.shape[0]),
        total_len=int(ids.shape[1]),
    )
    return sequences, layout


def _unpadded_positions(
    positions: Sequence[tuple[int, int]], layout: PaddedLayout, lengths: Sequence[int]
) -> list[Span]:
    """Column ranges of the padded batch (one per batch row) -> ranges of each sent
    sequence's own positions (clipped to its real tokens)."""
    if len(positions) != layout.batch_size:
        raise InvalidRequestError(
            f"positions: {len(positions)} (start, end) pairs for {layout.batch_size} rows"
        )
    out: list[Span] = []
    for row, offset, n in zip(layout.rows.tolist(), layout.offsets.tolist(), lengths, strict=True):
        start, end = check_span(positions[row], row, layout.total_len, "the padded batch's columns")
        lo = min(max(start - offset, 0), n)
        out.append((lo, max(lo, min(end - offset, n))))
    return out


def _padded_candidates(
    candidate_ids: Any, layout: PaddedLayout, spans: Sequence[Span]
) -> list[torch.Tensor]:
    """``[B, T, C]`` candidate ids laid out like the padded batch (column ``t``: the
    candidates of column ``t``) -> each sent sequence's rows ``[S_i, C]`` of its span."""
    cand = torch.as_tensor(
        candidate_ids.detach().cpu()
        if isinstance(candidate_ids, torch.Tensor)
        else np.asarray(candidate_ids)
    )
    want = (layout.batch_size, layout.total_len)
    if cand.dim() != 3 or tuple(cand.shape[:2]) != want:
        raise InvalidRequestError(
            f"candidate_ids: with an attention mask, expected [B, T, C] = "
            f"[{want[0]}, {want[1]}, C] like the padded batch, got {list(cand.shape)}"
        )
    return [
        cand[row, offset + lo : offset + hi]
        for row, offset, (lo, hi) in zip(
            layout.rows.tolist(), layout.offsets.tolist(), spans, strict=True
        )
    ]


def unpack_inputs(sequences: Any, attention_mask: Any = None) -> tuple[Any, Any]:
    """``(sequences, attention_mask)`` of a batch: a ``BatchEncoding`` / dict is unpacked
    (``input_ids`` and its ``attention_mask``, which must not be given twice); anything
    else passes through."""
    if isinstance(sequences, Mapping):
        if "input_ids" not in sequences:
            raise InvalidRequestError(
                f"sequences: a dict / BatchEncoding needs 'input_ids', got keys "
                f"{sorted(map(str, sequences))}"
            )
        if attention_mask is not None and sequences.get("attention_mask") is not None:
            raise InvalidRequestError(
                "attention_mask: given twice (as an argument and inside the inputs dict)"
            )
        if attention_mask is None:
            attention_mask = sequences.get("attention_mask")
        sequences = sequences["input_ids"]
    return sequences, attention_mask


def prepare_inputs(
    sequences: Any,
    attention_mask: Any = None,
    positions: Sequence[tuple[int, int]] | None = None,
    candidate_ids: Any = None,
) -> PreparedInputs:
    """Normalize one batch as the clients accept it.

    ``sequences`` is what :func:`topk_protocol.build_request` takes, or a
    tokenizer's ``BatchEncoding`` / a dict with ``input_ids`` (and ``attention_mask``).
    With an attention mask, the padding is cut off (:func:`unpad`), ``positions`` are
    column ranges of the padded batch and ``candidate_ids`` ``[B, T, C]`` is laid out
    like the padded batch (the candidates of column ``t`` at ``[:, t]``); without one,
    everything passes through unchanged.
    """
    sequences, attention_mask = unpack_inputs(sequences, attention_mask)
    if attention_mask is None:
        return PreparedInputs(
            sequences, None if positions is None else list(positions), None, candidate_ids
        )
    seqs, layout = unpad(sequences, attention_mask)
    lengths = [len(s) for s in seqs]
    spans = None if positions is None else _unpadded_positions(list(positions), layout, lengths)
    cands = (
        None
        if candidate_ids is None
        else _padded_candidates(
            candidate_ids, layout, spans if spans is not None else [(0, n) for n in lengths]
        )
    )
    return PreparedInputs(seqs, spans, layout, cands)


def place_rows(payload: TeacherPayload, layout: PaddedLayout) -> TeacherPayload:
    """Put a payload's rows at their columns of the padded ``[B, T]`` batch.

    Row ``j`` of sent sequence ``i`` goes to batch row ``layout.rows[i]``, column
    ``layout.offsets[i] + payload.position_start[i] + j``. Every other place holds the
    padding values of :mod:`student_client.data.payload` (ids 0, log-probs 0, ``mask`` False).

    Args:
        payload: ``[N, S, K]`` payload of the ``N`` sent sequences.
        layout: where they sit.

    Returns:
        ``[B, T, K]`` payload; ``position_start`` is 0 (row ``t`` is column ``t``) and
        ``lengths[b]`` is the number of real rows of batch row ``b``.
    """
    n, s = payload.ids.shape[:2]
    if n != len(layout.rows):
        raise ValueError(f"payload: {n} sequences, the layout places {len(layout.rows)}")
    b, t = layout.batch_size, layout.total_len
    device = payload.ids.device
    starts = (layout.offsets.to(device) + payload.position_start.to(device))[:, None]
    cols = starts + torch.arange(s, device=device)  # [N, S]
    rows = layout.rows.to(device)[:, None].expand(n, s)
    real = payload.mask
    if bool((cols[real] >= t).any()):
        raise ValueError(f"payload: rows reach past column {t - 1} of the padded batch")
    out = PayloadBuffers.like([payload], b, t, payload.top_k, device)
    out.put((rows[real], cols[real]), {k: v[real] for k, v in present_fields(payload).items()})
    mask = out.tensors["mask"]
    return out.payload(
        position_start=torch.zeros(b, dtype=torch.int64, device=device),
        lengths=mask.sum(dim=1),
        top_k=payload.top_k,
        dtype=payload.dtype,
        request_id=payload.request_id,
        teacher_seconds=payload.teacher_seconds,
        proposal_temperature=payload.proposal_temperature,
    )


def build_aligned_request(
    sequences: Any,
    top_k: int | RequestOptions,
    *,
    attention_mask: Any = None,
    positions: Sequence[tuple[int, int]] | None = None,
    request_id: str = "",
    candidate_ids: Any = None,
    **options: Any,
) -> tuple[pb.ScoreRequest, PaddedLayout | None]:
    """:func:`prepare_inputs` + :func:`topk_protocol.build_request`: the request for one
    batch (padding cut off; ``top_k`` and ``options`` as :meth:`RequestOptions.of`;
    ``candidate_ids`` laid out like the answer, see :func:`prepare_inputs`) and the
    layout to :func:`align` its answer with."""
    inputs = prepare_inputs(sequences, attention_mask, positions, candidate_ids)
    request = build_request(
        inputs.sequences,
        top_k,
        positions=inputs.positions,
        request_id=request_id,
        candidate_ids=inputs.candidate_ids,
        **options,
    )
    return request, inputs.layout


def align(payload: TeacherPayload, layout: PaddedLayout | None) -> TeacherPayload:
    """The payload placed into its batch's padded layout (unchanged when there is none)."""
    return payload if layout is None else place_rows(payload, layout)
