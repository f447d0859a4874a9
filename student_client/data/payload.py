"""What the client hands back: :class:`TeacherPayload`, the teacher's answer for a batch.

It is built by :class:`~student_client.data.assembler.ResponseAssembler` (live and
replayed answers) and by the dataset's collation (:mod:`student_client.offline.dataset`).

Padding of ragged batches: rows past a sequence's end have ``ids`` 0, ``logprobs`` 0,
``sampled_logprobs`` 0 and ``mask`` False. The values are finite (nothing turns into NaN
when a masked loss multiplies them by 0), and a loss that forgets the mask fails loudly
on them (ids repeated within a position) instead of training on them.

Candidates (when the request named candidate ids) follow one rule everywhere:
``candidate_ids == -1`` exactly where ``candidate_logprobs`` is NaN (padding inside a
row, padding rows, sequences sent without candidates), so a loss selects real entries
with ``candidate_ids >= 0`` and must not multiply the NaN away.

These pad values, dtypes and widths are written once, in the field table
(:data:`PAYLOAD_FIELDS`, from each field's metadata), and every padded payload is built
through it (:mod:`student_client.data.padding`). Adding a payload field touches the
proto, :class:`~topk_protocol.arrays.SequenceArrays`, the codec and its line here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Final, Literal

import torch

__all__ = ["PAYLOAD_FIELDS", "PayloadField", "TeacherPayload"]

#: The name of a padded field's last dimension: ``"K"`` (a column per top-k entry or
#: draw), ``"C"`` (a column per candidate id) or ``""`` (``[B, S]``, one value a row).
Width = Literal["K", "C", ""]


@dataclass(frozen=True)
class PayloadField:
    """How one ``[B, S, ...]`` tensor field of :class:`TeacherPayload` is laid out and
    padded: its ``dtype``, the ``pad`` value of padding rows (and columns), its last
    dimension's ``width`` and whether it may be None (``optional``)."""

    name: str
    dtype: torch.dtype
    pad: float | bool
    width: Width
    optional: bool

    def shape(self, batch_size: int, rows: int, top_k: int, num_candidates: int) -> tuple[int, ...]:
        """Its shape for ``batch_size`` sequences of ``rows`` rows."""
        width = {"K": (top_k,), "C": (num_candidates,), "": ()}[self.width]
        return (batch_size, rows, *width)


def _padded(dtype: torch.dtype, pad: float | bool, width: Width, optional: bool = False) -> Any:
    """The metadata of a :class:`TeacherPayload` tensor field (its :class:`PayloadField`)."""
    return {"padded": (dtype, pad, width, optional)}


@dataclass(frozen=True)
class TeacherPayload:
    """The teacher's answer for a batch of ``B`` sequences, padded to ``S`` rows.

    Row ``j`` of sequence ``b`` is absolute position ``position_start[b] + j``: the
    teacher's distribution over the token after ``x[position_start[b] + j]``
    (``docs/protocol.md``, position alignment), which lines up with a causal LM's
    ``logits[:, position_start[b] + j]``.

    Attributes:
        ids: ``[B, S, K]`` int64 token ids, each row sorted by log-prob, descending.
        logprobs: ``[B, S, K]`` float32 log-probs (the wire dtype widened exactly).
        sampled_logprobs: ``[B, S]`` float32 log-prob of the token that actually follows
            (NaN at a sequence's last position), or ``None`` when not requested.
        mask: ``[B, S]`` bool, True on real rows, False on padding (padding rows hold
            ids 0, log-probs 0, sampled log-probs 0).
        position_start: ``[B]`` int64 absolute position of row 0 of each sequence.
        lengths: ``[B]`` int64 number of real rows of each sequence.
        top_k: K.
        dtype: wire dtype of the log-probs (``"float16"``, ``"bfloat16"``, ``"float32"``).
        request_id: the request's id.
        teacher_seconds: engine time the teacher reported for the request.
        teachers: the name of the teacher that scored each sequence (``B`` names), from
            a multi-teacher client or recording; None from a single teacher.
        candidate_ids: ``[B, S, C]`` int64, the candidate ids the request named for each
            row (``-1``: padding), or None when it named none.
        candidate_logprobs: ``[B, S, C]`` float32, the teacher's log-prob at each
            candidate id, from the same distribution as ``logprobs`` (row ``t`` is
            ``log p(. | x[0..t])`` at the teacher temperature), NaN where the id is
            ``-1``; None when ``candidate_ids`` is.
        sample_counts: a sampled payload's ``[B, S, K]`` int64 draw counts (0: a padding
            column; a real row sums to N); ``ids`` then holds the distinct drawn ids and
            ``logprobs`` the teacher's log-probs at them. None for a top-k payload.
            ``student_client.losses.sampled_target_weights`` turns them into the target.
        proposal_log_normalizer: ``[B, S]`` float32 ``log Z`` of a tempered proposal
            (``proposal_temperature != 1``), else None.
        proposal_temperature: ``tau`` a sampled payload was drawn at (the request's; 1:
            from the teacher's ``p``), so that the loss's teacher value
            (``TeacherTargets.from_payload``) weighs the draws without being told.
    """

    ids: torch.Tensor = field(metadata=_padded(torch.int64, 0, "K"))
    logprobs: torch.Tensor = field(metadata=_padded(torch.float32, 0, "K"))
    sampled_logprobs: torch.Tensor | None = field(metadata=_padded(torch.float32, 0, "", True))
    mask: torch.Tensor = field(metadata=_padded(torch.bool, False, ""))
    position_start: torch.Tensor
    lengths: torch.Tensor
    top_k: int
    dtype: str
    request_id: str = ""
    teacher_seconds: float = 0.0
    teachers: tuple[str, ...] | None = None
    candidate_ids: torch.Tensor | None = field(
        default=None, metadata=_padded(torch.int64, -1, "C", True)
    )
    candidate_logprobs: torch.Tensor | None = field(
        default=None, metadata=_padded(torch.float32, float("nan"), "C", True)
    )
    sample_counts: torch.Tensor | None = field(
        default=None, metadata=_padded(torch.int64, 0, "K", True)
    )
    proposal_log_normalizer: torch.Tensor | None = field(
        default=None, metadata=_padded(torch.float32, 0, "", True)
    )
    proposal_temperature: float = 1.0

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_positions(self) -> int:
        """Real (unpadded) rows in the batch."""
        return int(self.lengths.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TeacherPayload:
        """The same payload with every tensor on ``device``."""
        moved: dict[str, Any] = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


#: The ``[B, S, ...]`` tensor fields of :class:`TeacherPayload`, in declaration order:
#: each one's dtype, pad value and width. The one table the padders go over
#: (:class:`~student_client.data.padding.PayloadBuffers`): a new payload field is declared
#: above with its metadata and is padded, stacked and placed everywhere without more code.
PAYLOAD_FIELDS: Final[tuple[PayloadField, ...]] = tuple(
    PayloadField(f.name, *f.metadata["padded"])
    for f in fields(TeacherPayload)
    if "padded" in f.metadata
)
