"""PayloadDataset + collate: items equal the recorded rows, batches equal what the replay
client (and so the teacher) returns for the same batch, and a shuffling DataLoader with
worker processes sees every row once per epoch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from recording_fakes import INFO, K, assert_bit_equal, teacher_answer
from torch.utils.data import DataLoader

from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay_client import ReplayClient
from topk_protocol import SequenceArrays
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingWriter


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "rec"
    with RecordingWriter(path, INFO, top_k=K, dtype="float32") as w:
        for i in range(12):
            tokens, full = teacher_answer(4 + 3 * i, seed=i)
            s = i % 3  # some rows start later than position 0
            w.add(tokens, full.rows(s, len(full)), dtype="float32")
    return path


@pytest.mark.parametrize(("k", "dtype"), [(K, "float32"), (5, "bfloat16"), (1, "float16")])
def test_collated_batches_equal_the_replayed_payloads(recording: Path, k: int, dtype: str) -> None:
    ds = PayloadDataset(recording, top_k=k, dtype=dtype, include_sampled=True)
    assert len(ds) == 12 and ds.vocab_size == 512
    order = [7, 2, 11, 0]
    batch = collate_payloads([ds[i] for i in order])
    with ReplayClient(recording) as replay:
        seqs = [ds[i].token_ids for i in order]
        starts = [ds[i].arrays.position_start for i in order]
        want = replay.score(
            seqs, k, dtype=dtype, positions=[(s, len(t)) for s, t in zip(starts, seqs, strict=True)]
        )
    assert_bit_equal(want, batch.payload)
    lengths = [len(t) for t in seqs]
    assert batch.token_ids.shape == (4, max(lengths))
    assert batch.attention_mask.sum(1).tolist() == lengths
    for b, t in enumerate(seqs):
        assert torch.equal(batch.token_ids[b, : len(t)], t)


def test_dataloader_shuffles_with_two_workers(recording: Path) -> None:
    """Spawned workers (the dataset pickles by path): a worker forked from this pytest
    process (which has run gRPC servers and clients) once spun forever, cause not pinned
    down. ``timeout`` turns a stuck worker into a failure."""
    ds = PayloadDataset(recording, include_sampled=False)
    loader = DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=2,
        collate_fn=collate_payloads,
        multiprocessing_context="spawn",
        persistent_workers=True,
        timeout=120,
    )
    for _epoch in range(2):
        seen = []
        for batch in loader:
            for b in range(batch.token_ids.shape[0]):
                n = int(batch.attention_mask[b].sum())
                seen.append(tuple(batch.token_ids[b, :n].tolist()))
            assert batch.payload.sampled_logprobs is None
        assert sorted(seen) == sorted(tuple(ds[i].token_ids.tolist()) for i in range(len(ds)))


def test_refuses_what_it_cannot_serve(recording: Path, tmp_path: Path) -> None:
    with pytest.raises(NotRecordedError, match="top_k: 17"):
        PayloadDataset(recording, top_k=17)
    path = tmp_path / "f16"
    tokens, full = teacher_answer(6, seed=1)
    with RecordingWriter(path, INFO, top_k=K, dtype="float16") as w:
        w.add(tokens, replace(full, sampled_logprobs=None), dtype="float32")
    with pytest.raises(
        NotRecordedError, match="holds float16 log-probs, which do not give the teacher's float32"
    ):
        PayloadDataset(path, dtype="float32")
    with pytest.raises(NotRecordedError, match="row 0: sampled log-probs are not recorded"):
        PayloadDataset(path)[0]  # the default asks for them (DEFAULT_INCLUDE_SAMPLED)
    assert np.array_equal(PayloadDataset(path, include_sampled=False)[0].arrays.ids, full.ids)


def test_items_are_sequence_arrays(recording: Path) -> None:
    item = PayloadDataset(recording, top_k=3, dtype="float16", include_sampled=False)[5]
    assert isinstance(item.arrays, SequenceArrays) and item.arrays.top_k == 3
    assert (item.dtype, item.teacher, item.arrays.sampled_logprobs) == ("float16", None, None)
    assert len(item.token_ids) == 4 + 3 * 5 and item.arrays.position_end == len(item.token_ids)
    f16 = item.arrays.logprobs.astype(np.float16).astype(np.float32)
    assert item.arrays.logprobs.tobytes() == f16.tobytes()  # the float16 values, widened
