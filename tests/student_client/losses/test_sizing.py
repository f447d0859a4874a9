"""Chunk sizes: the one rule (`rows_within`) and the fused loss's row chunks
(`auto_chunk_rows` is tested with the chunked loss)."""

from __future__ import annotations

import torch

from student_client.losses.sizing import (
    FUSED_BLOCK_BYTES_RANGE,
    FUSED_ROW_CHUNKS,
    FUSED_WORK_BYTES,
    fused_chunks,
    rows_within,
)

CPU = torch.device("cpu")


def test_rows_within_is_at_least_one() -> None:
    assert rows_within(8000, 1000) == 8
    assert rows_within(10, 1000) == 1
    assert rows_within(10, 0) == 10


def test_fused_rows_split_into_equal_chunks_at_large_vocabulary() -> None:
    for n_rows in (2048, 4096, 8192):
        chunks = fused_chunks(n_rows, 248_320, 2, CPU)
        count = -(-n_rows // chunks.block_rows)
        assert count == FUSED_ROW_CHUNKS
        assert n_rows - (count - 1) * chunks.block_rows > chunks.block_rows - count  # equal
        assert chunks.work_rows == FUSED_WORK_BYTES["cpu"] // (248_320 * 4)


def test_fused_block_stays_within_its_byte_range() -> None:
    low, high = FUSED_BLOCK_BYTES_RANGE
    row_bytes = 32768 * 2
    small = fused_chunks(1000, 32768, 2, CPU)  # a sixth would be 10 MiB: the floor wins
    assert small.block_rows == 1000 // -(-1000 // (low // row_bytes))
    assert small.block_rows * row_bytes <= low
    huge = fused_chunks(10**6, 32768, 2, CPU)
    assert huge.block_rows * row_bytes <= high
    assert huge.block_rows * row_bytes > high * 0.95  # equal chunks: a little below


def test_chunk_size_overrides_the_fused_rule_and_devices_differ_in_work_rows() -> None:
    assert fused_chunks(4096, 1000, 2, CPU, chunk_size=7).block_rows == 7
    meta = fused_chunks(4096, 1000, 2, torch.device("meta"))
    assert meta.work_rows == FUSED_WORK_BYTES["other"] // 4000
