"""Payload datasets for training loops: a recording as a ``torch.utils.data.Dataset``.

    from torch.utils.data import DataLoader
    from student_client.offline.dataset import PayloadDataset, collate_payloads

    ds = PayloadDataset("runs/scored")                  # a recording directory
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                        collate_fn=collate_payloads)
    for batch in loader:                                # many epochs, no teacher
        logits = student(input_ids=batch.token_ids).logits          # [B, L, V]
        loss = topk_kl_loss(logits, batch.payload.ids, batch.payload.logprobs,
                            mask=batch.payload.mask, ...)

Item ``i`` is recorded row ``i``, a :class:`PayloadItem`: ``token_ids`` ``[L]`` int64 and
the row's :class:`~topk_protocol.arrays.SequenceArrays` (``[S, K]`` ids and log-probs as
served: K' columns, the dtype's values widened to float32). The collate
function pads to the longest sequence / payload in the batch and returns a
:class:`PayloadBatch` whose ``payload`` is the :class:`~student_client.data.payload.TeacherPayload`
the live client returns for the same batch (row ``j`` of sequence ``b`` is position
``payload.position_start[b] + j``, padding rows masked out).

A multi-teacher recording (:mod:`topk_protocol.recording.multi_recording`) is the rows of every
teacher, teacher after teacher (in the manifest's order); each item names its
``teacher``, and a collated batch's ``payload.teachers`` (and :attr:`PayloadBatch.teachers`)
is the teacher column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from student_client.data.padding import PayloadBuffers, present_fields
from student_client.data.payload import TeacherPayload
from topk_protocol import DEFAULT_INCLUDE_SAMPLED, RequestOptions, SequenceArrays, TeacherInfo
from topk_protocol.errors import NotRecordedError
from topk_protocol.packing import packed_roundtrip
from topk_protocol.recording import RecordingReader
from topk_protocol.recording.format import cast_arrays
from topk_protocol.recording.multi_recording import (
    read_manifest,
    recorded_teachers,
    teacher_recording_path,
)
from topk_protocol.recording.replay import check_options, recorded_arrays
from topk_protocol.recording.sharded import Part, holds_recording, list_parts
from topk_protocol.storage import location

__all__ = ["PayloadBatch", "PayloadDataset", "PayloadItem", "collate_payloads"]


class PayloadItem(NamedTuple):
    """One dataset item: a recorded sequence and its payload.

    ``token_ids`` ``[L]`` int64; ``arrays``: rows ``j`` = position
    ``arrays.position_start + j`` (``ids`` ``[S, K]``, ``logprobs`` ``[S, K]`` float32,
    ``sampled_logprobs`` ``[S]`` or None, ``candidate_ids`` / ``candidate_logprobs``
    ``[S, C]`` as recorded or None); ``dtype``: the log-prob dtype whose values they
    hold; ``teacher``: its teacher's name in a multi-teacher recording (else None).
    """

    token_ids: torch.Tensor
    arrays: SequenceArrays
    dtype: str
    teacher: str | None = None


@dataclass(frozen=True)
class PayloadBatch:
    """A collated batch: ``token_ids`` ``[B, L]`` int64 (padded with ``pad_id``),
    ``attention_mask`` ``[B, L]`` bool, and the teacher ``payload`` (``[B, S, K]``)."""

    token_ids: torch.Tensor
    attention_mask: torch.Tensor
    payload: TeacherPayload

    @property
    def teachers(self) -> tuple[str, ...] | None:
        """The teacher of each row (a multi-teacher recording), else None."""
        return self.payload.teachers


class PayloadDataset(Dataset[PayloadItem]):
    """The rows of a recording, as :class:`PayloadItem` items.

    Args:
        path: the recording directory: a local path or a URI (``s3://bucket/prefix``;
            :mod:`topk_protocol.storage`), streamed without downloading it whole.
        top_k: K' <= the recorded K (the top-K' prefix of each row); default: recorded K.
        dtype: log-prob dtype to serve, the values the teacher would have sent in it
            (float32 recordings serve every dtype); default: the recorded one.
        include_sampled: also return sampled log-probs (every row must have them);
            default: ``DEFAULT_INCLUDE_SAMPLED`` (True), the request options' default, so
            that a batch holds what the live client returns for the same options. Pass
            False for a recording made without them.
        encoding, logprob_bits: serve what a ``"packed"`` answer at ``logprob_bits``
            decodes to (a packed recording: its own, the default; a float32 one: packed
            as the teacher packs); default: the recording's encoding.

    Picklable (it reopens the directory), so ``DataLoader`` workers of any start method
    work; under ``fork`` they share the parent's decoded buffers.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        top_k: int | None = None,
        dtype: str | None = None,
        include_sampled: bool = DEFAULT_INCLUDE_SAMPLED,
        encoding: str | None = None,
        logprob_bits: int | None = None,
    ) -> None:
        self.path = location(path)
        self._options = {
            "top_k": top_k,
            "dtype": dtype,
            "include_sampled": include_sampled,
            "encoding": encoding,
            "logprob_bits": logprob_bits,
        }
        self.include_sampled = include_sampled
        shards = list_parts(self.path)
        names = None if read_manifest(self.path) is None else recorded_teachers(self.path)
        #: ``(teacher name or None, dataset)`` of each part, in order: the teachers of a
        #: multi-teacher recording, or the shards of a sharded one (each maybe multi-teacher).
        self._parts: list[tuple[str | None, PayloadDataset]] = []
        if shards or names is not None:
            self._parts = self._open_parts(shards, names)
            first = self._parts[0][1]
            self._reader = first.reader
            self.top_k: int = first.top_k
            self.dtype: str = first.dtype
            self._starts = np.cumsum([0] + [len(d) for _, d in self._parts])
            return
        self._reader = RecordingReader(self.path)
        try:
            self._served = _served_options(
                self._reader,
                f"recording {self.path}",
                top_k,
                dtype,
                include_sampled,
                encoding,
                logprob_bits,
            )
        except BaseException:
            self._reader.close()
            raise
        self.top_k = self._served.top_k
        self.dtype = self._served.dtype

    def _open_parts(
        self, shards: list[Part], names: list[str] | None
    ) -> list[tuple[str | None, PayloadDataset]]:
        """The parts of a sharded recording (``shards``: those with rows) or the teachers of
        a multi-teacher one (``names``), each opened with this dataset's options; they must
        agree on vocabulary, tokenizer and temperature, on K and dtype, and a sharded
        recording's parts (replicas of one teacher) on their answers."""
        from student_client.clients.routing import check_agreement
        from student_client.offline.verify import check_same_answers

        located: list[tuple[str | None, str | Path]]
        if shards:
            counts = {p.num_shards for p in shards}
            if len(counts) > 1:
                raise NotRecordedError(
                    f"recording {self.path}: parts of several shard counts {sorted(counts)}"
                )
            # A part with no rows (a shard of no input) holds no recording.
            located = [(None, location(p.location)) for p in shards if _has_rows(p.location)]
            if not located:
                raise NotRecordedError(f"recording {self.path}: no part has rows recorded")
        else:
            if not names:
                raise NotRecordedError(f"recording {self.path}: no teacher has rows recorded")
            located = [(n, teacher_recording_path(self.path, n)) for n in names]
        parts = [
            (n, PayloadDataset(loc, **self._options))  # type: ignore[arg-type]
            for n, loc in located
        ]
        check_agreement(
            {str(d.path): TeacherInfo.from_message(d.reader.info) for _, d in parts},
            {str(d.path): [str(d.path)] for _, d in parts},
        )
        first = parts[0][1]
        if shards:  # parts of one teacher's recording: its replicas must agree
            check_same_answers([(str(d.path), d.reader.info) for _, d in parts])
        for _, d in parts[1:]:
            if (d.top_k, d.dtype) != (first.top_k, first.dtype):
                raise NotRecordedError(
                    f"recording {d.path}: K {d.top_k} {d.dtype}, but {first.path} has "
                    f"K {first.top_k} {first.dtype}"
                )
        return parts

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], **state["options"])  # type: ignore[misc]

    @property
    def reader(self) -> RecordingReader:
        """The recording's reader (a multi-teacher recording: its first teacher's; the
        teachers agree on vocabulary, tokenizer and temperature, checked at open)."""
        return self._reader

    @property
    def teachers(self) -> list[str]:
        """The teachers of a multi-teacher recording (else empty)."""
        return [n for n, _ in self._parts if n is not None]

    @property
    def vocab_size(self) -> int:
        return int(self._reader.info.vocab_size)

    def __len__(self) -> int:
        if self._parts:
            return int(self._starts[-1])
        return len(self._reader)

    def __getitem__(self, i: int) -> PayloadItem:
        if self._parts:
            if not 0 <= int(i) < len(self):
                raise IndexError(f"row {i} of a recording with {len(self)} rows")
            part = int(np.searchsorted(self._starts, int(i), side="right")) - 1
            name, ds = self._parts[part]
            item = ds[int(i) - int(self._starts[part])]
            return item if name is None else item._replace(teacher=name)
        tokens, row = self._reader.row(int(i))
        if self.include_sampled and row.sampled_logprobs is None:
            raise NotRecordedError(
                f"recording {self.path}: row {i}: sampled log-probs are not recorded "
                "(include_sampled=True is the default; pass include_sampled=False)"
            )
        recorded = arrays = replace(  # the row's candidates as recorded (the row is whole)
            recorded_arrays(row, row.position_start, row.position_end, self._served),
            candidate_ids=row.candidate_ids,
            candidate_logprobs=row.candidate_logprobs,
        )
        if self._reader.dtype != self.dtype:  # a float32 recording, another dtype asked
            arrays = cast_arrays(arrays, self.dtype)
        bits = self._served.logprob_bits
        if bits is not None and self._reader.packing is None:  # float32 values, packed asked
            arrays = replace(arrays, logprobs=packed_roundtrip(recorded.logprobs, bits, self.dtype))
        return PayloadItem(torch.from_numpy(tokens.astype(np.int64)), arrays, self.dtype)


def _has_rows(part: str) -> bool:
    """Whether a part of a sharded recording holds a recording with rows (a shard of no
    input rows holds none, or a multi-teacher manifest and no teacher's rows)."""
    if not holds_recording(part):
        return False
    return read_manifest(part) is None or bool(recorded_teachers(part))


def _served_options(
    reader: RecordingReader,
    where: str,
    top_k: int | None,
    dtype: str | None,
    include_sampled: bool,
    encoding: str | None,
    logprob_bits: int | None,
) -> RequestOptions:
    """The options a single recording serves its rows at: the asked ones, each defaulting
    to the recording's own (a packed recording: its encoding and bits), with the options
    it was recorded at (e.g. ``samples``, ``seed``). Raises
    :class:`~topk_protocol.errors.InvalidRequestError` for invalid options and
    :class:`~topk_protocol.errors.NotRecordedError`, naming ``where``, for options the
    recording cannot serve."""
    own = reader.packing if encoding is None else None  # a packed recording's own
    recorded = {**RequestOptions.recorded_defaults(), **reader.options}  # e.g. samples, seed
    opts = RequestOptions(
        reader.top_k if top_k is None else top_k,
        dtype or reader.dtype,
        include_sampled,
        "packed" if own else encoding or "default",
        own.logprob_bits if own and logprob_bits is None else logprob_bits,
        **recorded,
    )
    check_options(reader, opts, where)
    return opts


def collate_payloads(items: Sequence[PayloadItem], pad_id: int = 0) -> PayloadBatch:
    """Pad a list of dataset items into a :class:`PayloadBatch` (padding rows: ids 0,
    log-probs 0, sampled 0, mask False, as the live client pads; candidates, when any
    item has them, ``[B, S, C_max]`` with ``-1`` / NaN padding)."""
    if not items:
        raise ValueError("items: empty batch")
    lengths = [len(it.token_ids) for it in items]
    rows = [len(it.arrays) for it in items]
    # numpy buffers (PayloadBuffers): np.zeros gets lazily zeroed pages from the OS,
    # where torch.zeros fills them with its thread pool (slow on a busy CPU).
    tokens = np.full((len(items), max(lengths)), pad_id, dtype=np.int64)
    attn = np.zeros((len(items), max(lengths)), dtype=np.bool_)
    k = items[0].arrays.top_k
    out = PayloadBuffers.like([it.arrays for it in items], len(items), max(rows), k)
    for j, it in enumerate(items):
        tokens[j, : len(it.token_ids)] = it.token_ids.numpy()
        attn[j, : len(it.token_ids)] = True
        out.put((j, slice(0, rows[j])), {**present_fields(it.arrays), "mask": True})
    names = [it.teacher for it in items]
    payload = out.payload(
        position_start=torch.tensor([it.arrays.position_start for it in items], dtype=torch.int64),
        lengths=torch.tensor(rows, dtype=torch.int64),
        top_k=k,
        dtype=items[0].dtype,
        teachers=None if any(n is None for n in names) else tuple(str(n) for n in names),
    )
    return PayloadBatch(torch.from_numpy(tokens), torch.from_numpy(attn), payload)
