"""The teacher columns' share of the fused loss's `grad_weight`, summed in fp32.

With a bf16 / fp16 weight, the fused loss sums `grad_weight = sum_chunks G_c.T @ h_c` in
the weight's dtype, one rounding per row chunk. Those roundings are relative to the running
sum, and most of a vocabulary row's gradient often comes from the few rows where that id is
one of the teacher's top-k (the `b q_i - p_i` term of docs/losses.md "Gradient"): an id
that is in the top-k of rows of two chunks is rounded at full size twice. So the fused
loss takes the teacher columns out of the rounded running sum (`zero_columns_` on the
chunk's bf16 gradient block, after `grad_hidden` used it) and keeps their fp32 values
(`[N, K]`); at the end `column_sums` adds each id's `sum_rows value * hidden[row]` in fp32
to the running sum, rounded once. The rest of each row's sum (the dense `a q_j` part) is
rounded per chunk as before, at its own, usually much smaller, size.

Cost: `N K` entries of `H` multiply-adds each, against the `3 N V H` of the loss's
matmuls; memory: the `[N, K]` values during the chunk loop, an fp32 copy of `hidden`
and one batch of sums at the end (after the chunk buffers are freed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__: list[str] = []


def zero_columns_(block: Tensor, index: Tensor, owned: Tensor | None) -> None:
    """In place: `block` `[n, V_local]` (contiguous) <- 0 at the columns `index` `[n, K]`
    of each row (owned entries only; `owned` None: all).

    (`index_fill_` on the flat view: `scatter_` into a bf16 block on CPU would make an fp32
    copy of the whole block.)
    """
    rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    flat = rows * block.shape[1] + index
    block.view(-1).index_fill_(0, flat.reshape(-1) if owned is None else flat[owned], 0)


class ColumnEntries(NamedTuple):
    """Nonzero teacher-column gradients, sorted by column: `columns`, `rows` (int64) and
    `values` (fp32), `[E]` each."""

    columns: Tensor
    rows: Tensor
    values: Tensor


def column_entries(index: Tensor, owned: Tensor | None, values: Tensor) -> ColumnEntries:
    """The owned, nonzero entries of `values` `[N, K]` at local columns `index` `[N, K]`,
    sorted by column (stably: the sums below do not depend on the chunking)."""
    keep = values != 0
    if owned is not None:
        keep &= owned
    rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1).expand_as(index)
    columns = index[keep]
    order = torch.argsort(columns, stable=True)
    return ColumnEntries(columns[order], rows[keep][order], values[keep][order])


def column_sums(
    entries: ColumnEntries, hidden: Tensor, batch_columns: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Per distinct column `c` of `entries`: `sum_e values[e] * hidden[rows[e]]` over its
    entries, in fp32. Yields `(columns [U], sums [U, H])` for at most `batch_columns`
    columns at a time (ascending, each column in one batch).

    `hidden` `[N, H]` any float dtype (upcast once). `embedding_bag` (sum mode with
    per-sample weights) gathers and sums the rows in one kernel, without a `[E, H]`
    temporary.
    """
    if entries.columns.numel() == 0:
        return
    table = hidden.float()
    columns, counts = torch.unique_consecutive(entries.columns, return_counts=True)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    for first in range(0, columns.shape[0], batch_columns):
        last = min(first + batch_columns, columns.shape[0])
        begin, end = int(starts[first]), int(ends[last - 1])
        sums = F.embedding_bag(
            entries.rows[begin:end],
            table,
            starts[first:last] - begin,
            mode="sum",
            per_sample_weights=entries.values[begin:end],
        )
        yield columns[first:last], sums
