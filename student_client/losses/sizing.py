"""Chunk sizes of the chunked and the fused losses: one rule and its budgets.

The rule (`rows_within`): a chunk has as many rows as fit a byte budget, at least one.
`topk_kl_loss` applies it to its fp32 work block; `lm_head_topk_kl_loss` to its logits block
(whose budget grows with the logits the path never forms, docs/lm_head_loss.md "Chunk sizes")
and to the fp32 sub-block its loss math runs on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FUSED_BLOCK_BYTES_RANGE",
    "FUSED_ROW_CHUNKS",
    "FUSED_WEIGHT_SLICE_BYTES",
    "FUSED_WORK_BYTES",
    "FusedChunks",
    "auto_chunk_rows",
    "column_batch_entries",
    "fused_chunks",
    "rows_within",
]

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""`topk_kl_loss`: size of the fp32 work block of one chunk (64 MiB)."""

FUSED_ROW_CHUNKS = 6
"""Fused loss: the rows are split into this many chunks of equal size, as long as one block
stays within `FUSED_BLOCK_BYTES_RANGE`. The block is then a sixth of the `[N, V_local]`
logits the path never forms, so the block, `grad_hidden` (`H / V` of the logits), the fp32
sub-block and the per-row values stay below the 0.25x of the logits the path may use beyond
the parameter gradients, with room to spare (five chunks measured within 10 MiB of it at
V = 248k, N = 2048); the matmuls still have hundreds of rows at V = 248k; and the running
sum of `grad_weight` is rounded once per chunk in the weight's dtype, at the size of its
dense part only (the teacher columns are summed in fp32, `split_columns`)."""

FUSED_BLOCK_BYTES_RANGE = (64 * 2**20, 2**30)
"""Fused loss: least and most bytes of one logits block (64 MiB, 1 GiB)."""

FUSED_WORK_BYTES = {"cpu": 16 * 2**20, "other": DEFAULT_CHUNK_BYTES}
"""Fused loss: the fp32 sub-block the loss math runs on: 16 MiB on CPU (measured faster
than 64 MiB there: it stays in cache), 64 MiB elsewhere (fewer, larger kernel launches on
a GPU; not measured)."""


FUSED_WEIGHT_SLICE_BYTES = 4 * 2**20
"""Fused loss, "compensated" / "float32" accumulation: `grad_weight` is combined in
vocabulary slices of this many bytes of the weight's dtype (reused fp32 temporaries)."""


def column_batch_entries(block_bytes: int, hidden_size: int, device: torch.device) -> int:
    """Fused loss, bf16 / fp16 weight: entries per batch of the teacher columns' fp32 sums
    (`split_columns.column_sums`). On a CPU each fp32 `[B, H]` temporary is
    `FUSED_WEIGHT_SLICE_BYTES` (it stays in cache; larger batches measured several times
    slower there); elsewhere the batch's four fp32 `[B, H]` temporaries fit in the logits
    block's `block_bytes`, freed by then (fewer, larger kernel launches; the batches do not
    raise the peak)."""
    if device.type == "cpu":
        return rows_within(FUSED_WEIGHT_SLICE_BYTES, 4 * hidden_size)
    return rows_within(max(block_bytes, FUSED_WEIGHT_SLICE_BYTES), 16 * hidden_size)


def rows_within(budget_bytes: int, row_bytes: int) -> int:
    """Rows of `row_bytes` each that fit `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // max(1, row_bytes))


def auto_chunk_rows(
    local_vocab: int, *, element_bytes: int = 4, budget_bytes: int = DEFAULT_CHUNK_BYTES
) -> int:
    """Rows per chunk so that one `[rows, local_vocab]` work block fits `budget_bytes` (>= 1)."""
    return rows_within(budget_bytes, local_vocab * element_bytes)


class FusedChunks(NamedTuple):
    """Rows of the fused loss's logits block (one pass of its three matmuls) and of the fp32
    sub-block its loss math runs on."""

    block_rows: int
    work_rows: int


def fused_chunks(
    n_rows: int,
    local_vocab: int,
    element_bytes: int,
    device: torch.device,
    chunk_size: int | None = None,
) -> FusedChunks:
    """The fused loss's chunk rows for `[n_rows, H]` hidden states and a `[local_vocab, H]`
    weight of `element_bytes` per element; `chunk_size` (rows per block) overrides the rule."""
    row_bytes = local_vocab * element_bytes
    if chunk_size is not None:
        block_rows = chunk_size
    else:
        low, high = (rows_within(limit, row_bytes) for limit in FUSED_BLOCK_BYTES_RANGE)
        block_rows = min(max(-(-n_rows // FUSED_ROW_CHUNKS), low), high)
        chunks = max(1, -(-n_rows // block_rows))
        block_rows = max(1, -(-n_rows // chunks))  # equal chunks, none of a few rows
    work_bytes = FUSED_WORK_BYTES["cpu" if device.type == "cpu" else "other"]
    return FusedChunks(block_rows=block_rows, work_rows=rows_within(work_bytes, local_vocab * 4))
