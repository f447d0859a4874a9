"""A Ray Data stage that adds a teacher's payload columns to a Dataset, and writing its
output as a recording that ``PayloadDataset`` reads (docs/ray.md).

    ds = ray.data.read_parquet("s3://corpus/tokens.parquet")
    ds = ds.map_batches(TeacherPayloads, fn_constructor_args=(pool.targets(), 16),
                        batch_size=8, concurrency=2)        # + topk_ids, topk_logprobs, ...
    write_recording(ds, "s3://recordings/run-1", pool.targets())

Each stage actor holds one ``TeacherClient`` over the replicas and streams its batches
through it (the client's fail-over, retries and fingerprint checks apply). The columns, per
row (a sequence of ``L`` tokens, every position scored): ``topk_ids`` and
``topk_logprobs`` (``[L][K]``, int32 and float32 in the wire dtype's values),
``sampled_logprobs`` (``[L]``, NaN at the last position) and ``payload_dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TeacherPayloads", "write_recording"]


class TeacherPayloads:
    """The ``map_batches`` callable: ``targets`` (a pool's replicas), K ``top_k``, wire
    ``dtype``, the token column ``column``; further keywords go to ``TeacherClient``."""

    def __init__(
        self,
        targets: Sequence[str],
        top_k: int,
        dtype: str = "float32",
        column: str = "input_ids",
        depth: int = 4,
        **client_kwargs: Any,
    ) -> None:
        from student_client import TeacherClient

        self._client = TeacherClient(list(targets), **client_kwargs)
        self._top_k, self._dtype, self._column, self._depth = top_k, dtype, column, depth

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        seqs = [np.asarray(s, dtype=np.int64).tolist() for s in batch[self._column]]
        payload = self._client.score(seqs, self._top_k, dtype=self._dtype)
        ids, lps, sampled = [], [], []
        for b, seq in enumerate(seqs):
            n = int(payload.lengths[b])
            assert int(payload.position_start[b]) == 0 and n == len(seq)
            ids.append(payload.ids[b, :n].numpy().astype(np.int32))
            lps.append(payload.logprobs[b, :n].numpy().astype(np.float32))
            s = payload.sampled_logprobs
            sampled.append(
                np.full(n, np.nan, np.float32) if s is None else s[b, :n].numpy().astype(np.float32)
            )
        out = dict(batch)
        out["topk_ids"] = ids
        out["topk_logprobs"] = lps
        out["sampled_logprobs"] = sampled
        out["payload_dtype"] = [self._dtype] * len(seqs)
        return out


def _teacher_info(targets: Sequence[str]) -> Any:
    """The first answering replica's ``GetInfo`` message (what a recording stores)."""
    import grpc

    from topk_protocol import pb, pb_grpc

    errors = []
    for target in targets:
        with grpc.insecure_channel(target) as channel:
            try:
                return pb_grpc.TeacherStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
            except grpc.RpcError as e:
                errors.append(f"{target}: {e.code().name}")
    raise RuntimeError(f"teacher info: no replica answered ({'; '.join(errors)})")


def write_recording(
    ds: Any, output: str, targets: Sequence[str], *, column: str = "input_ids"
) -> int:
    """Write a Dataset that went through :class:`TeacherPayloads` as one recording at
    ``output`` (a path or URI; rows in the Dataset's order), with the teacher's info of
    ``targets``; returns the rows written. Read it with ``PayloadDataset``."""
    from topk_protocol import SequenceArrays
    from topk_protocol.recording import RecordingWriter

    rows = 0
    writer = None
    try:
        for batch in ds.iter_batches(batch_format="numpy"):
            for i in range(len(batch[column])):
                ids = np.stack(batch["topk_ids"][i]).astype(np.int32)
                lps = np.stack(batch["topk_logprobs"][i]).astype(np.float32)
                dtype = str(batch["payload_dtype"][i])
                if writer is None:
                    writer = RecordingWriter(
                        output, _teacher_info(targets), top_k=ids.shape[1], dtype=dtype
                    )
                sampled = np.asarray(batch["sampled_logprobs"][i], dtype=np.float32)
                writer.add(
                    np.asarray(batch[column][i]), SequenceArrays(ids, lps, sampled, 0), dtype=dtype
                )
                rows += 1
    finally:
        if writer is not None:
            writer.close()
    return rows
