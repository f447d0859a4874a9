"""Pad, stack and place payload rows: the one helper behind every padded ``TeacherPayload``.

:class:`PayloadBuffers` holds a ``[B, S, ...]`` buffer of each :class:`TeacherPayload`
tensor field present, filled with the field's pad value (:data:`PAYLOAD_FIELDS`), takes
rows into them (:meth:`~PayloadBuffers.put`, or numpy views to decode into,
:meth:`~PayloadBuffers.views`) and turns them into the payload
(:meth:`~PayloadBuffers.payload`). Every padded payload is built by it: the answer of one
request (:mod:`student_client.data.assembler`), a payload placed into its padded batch
(:func:`student_client.data.alignment.place_rows`), the teachers' answers merged back in
input order (:func:`student_client.clients.routing.merge_payloads`) and a dataset batch
(:func:`student_client.offline.dataset.collate_payloads`). It goes over the field table,
so a new payload field needs no code here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from student_client.data.payload import PAYLOAD_FIELDS, PayloadField, TeacherPayload

__all__ = ["PayloadBuffers", "present_fields"]

_BY_NAME: dict[str, PayloadField] = {f.name: f for f in PAYLOAD_FIELDS}


def present_fields(part: Any) -> dict[str, Any]:
    """``{name: value}`` of the payload fields ``part`` holds (a
    :class:`TeacherPayload` or a :class:`~topk_protocol.arrays.SequenceArrays`: the
    fields of the table it has and that are not None)."""
    return {
        f.name: value for f in PAYLOAD_FIELDS if (value := getattr(part, f.name, None)) is not None
    }


#: Each field's numpy dtype, for the CPU buffers (worked out once: asking torch per
#: buffer costs more than a small batch's decode).
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    f.name: torch.empty(0, dtype=f.dtype).numpy().dtype for f in PAYLOAD_FIELDS
}


class PayloadBuffers:
    """Padded ``[B, S, ...]`` buffers of the :class:`TeacherPayload` fields present.

    Args:
        present: the optional fields to hold (the required ones are always held).
        batch_size: ``B``.
        rows: ``S``.
        top_k: ``K``, the width of the ``"K"`` fields.
        num_candidates: ``C``, the width of the ``"C"`` fields (the widest row's).
        device: where the buffers live. On the CPU they are numpy arrays shared with
            the tensors (``np.zeros`` takes lazily zeroed pages from the OS where
            ``torch.zeros`` fills them with its thread pool, slow on a busy CPU).
    """

    def __init__(
        self,
        present: Iterable[str],
        batch_size: int,
        rows: int,
        top_k: int,
        num_candidates: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        wanted = set(present)
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        for f in PAYLOAD_FIELDS:
            if f.optional and f.name not in wanted:
                continue
            shape = f.shape(batch_size, rows, top_k, num_candidates)
            if self.device.type == "cpu":
                dtype = _NUMPY_DTYPES[f.name]
                arr = np.zeros(shape, dtype) if f.pad == 0 else np.full(shape, f.pad, dtype)
                self._arrays[f.name] = arr
                self.tensors[f.name] = torch.from_numpy(arr)
            else:
                self.tensors[f.name] = torch.full(shape, f.pad, dtype=f.dtype, device=device)

    @classmethod
    def like(
        cls,
        parts: Iterable[Any],
        batch_size: int,
        rows: int,
        top_k: int,
        device: torch.device | str = "cpu",
    ) -> PayloadBuffers:
        """Buffers for the rows of ``parts`` (payloads or sequence arrays): an optional
        field is held when any part has it, ``C`` is the widest part's."""
        present: set[str] = set()
        widest = 0
        for part in parts:
            fields = present_fields(part)
            present |= fields.keys()
            widest = max(
                [widest] + [int(v.shape[-1]) for n, v in fields.items() if _BY_NAME[n].width == "C"]
            )
        return cls(present, batch_size, rows, top_k, widest, device)

    def _target(self, name: str, value: Any) -> Any:
        """The buffer ``value`` is written into: the numpy array for numpy values and
        scalars (CPU), else the tensor."""
        if name in self._arrays and not isinstance(value, torch.Tensor):
            return self._arrays[name]
        return self.tensors[name]

    def put(self, where: tuple[Any, ...], values: Mapping[str, Any]) -> None:
        """Write ``values[name]`` at ``buffer[where]`` for each field held (others are
        skipped; a ``"C"`` field into its first ``values[name].shape[-1]`` columns).

        ``where`` indexes the leading ``[B, S]`` dimensions: ``(b, slice(0, n))`` for a
        sequence's ``n`` rows, ``(row_indices, slice(0, n))`` for several, or
        ``(row_indices, column_indices)`` for scattered rows.
        """
        for name, value in values.items():
            if value is None or name not in self.tensors:
                continue
            index = where
            if _BY_NAME[name].width == "C":
                index = (*where, slice(0, int(value.shape[-1])))
            self._target(name, value)[index] = value

    def views(self, where: tuple[Any, ...], num_candidates: int) -> dict[str, npt.NDArray[Any]]:
        """Numpy views of every field held at ``buffer[where]`` (the ``"C"`` fields'
        first ``num_candidates`` columns), to decode into (CPU buffers only)."""
        return {
            name: arr[(*where, slice(0, num_candidates))]
            if _BY_NAME[name].width == "C"
            else arr[where]
            for name, arr in self._arrays.items()
        }

    def payload(
        self,
        *,
        position_start: torch.Tensor,
        lengths: torch.Tensor,
        top_k: int,
        dtype: str,
        **meta: Any,
    ) -> TeacherPayload:
        """The buffers as a :class:`TeacherPayload` (``meta``: its other fields,
        ``request_id``, ``teachers``, ...)."""
        tensors = {f.name: self.tensors.get(f.name) for f in PAYLOAD_FIELDS}
        return TeacherPayload(
            **tensors,  # type: ignore[arg-type]
            position_start=position_start,
            lengths=lengths,
            top_k=top_k,
            dtype=dtype,
            **meta,
        )
