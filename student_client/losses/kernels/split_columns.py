"""The teacher columns' share of the fused loss's `grad_weight`, summed in fp32.

With a bf16 / fp16 weight, the fused loss sums `grad_weight = sum_chunks G_c.T @ h_c` in
the weight's dtype, one rounding per row chunk. Those roundings are relative to the running
sum, and most of a vocabulary row's gradient often comes from the few rows where that id is
one of the teacher's top-k (the `b q_i - p_i` term of docs/losses.md "Gradient"): an id
that is in the top-k of rows of two chunks is rounded at full size twice. So the fused
loss takes the teacher columns out of the rounded running sum (`zero_columns_` on the
chunk's bf16 gradient block, after `grad_hidden` used it) and keeps their fp32 values
(`[N, K]`); at the end `column_sums` gives each id's `sum_rows value * hidden[row]` in
fp32, added to the running sum before its one rounding. The rest of each row's sum (the
dense `a q_j` part) is rounded per chunk as before, at its own, usually much smaller, size.

Nothing here waits for the device (no data-dependent sizes): every entry is kept (a
not-owned one has the value 0), the entries are sorted by column and summed in batches of a
fixed number of entries, and a column cut by a batch boundary carries its partial sum into
the next batch; the number of distinct columns is never read back.

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
    copy of the whole block. With `owned`, each owned entry adds minus its value and every
    other entry adds 0: exact, whatever the order, also where a not-owned entry points at
    an owned entry's column, and no boolean indexing.)
    """
    rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    flat = (rows * block.shape[1] + index).reshape(-1)
    values = block.view(-1)
    if owned is None:
        values.index_fill_(0, flat, 0)
        return
    current = values.index_select(0, flat)
    zero = torch.zeros((), dtype=block.dtype, device=block.device)
    values.index_add_(0, flat, torch.where(owned.reshape(-1), -current, zero))


class ColumnEntries(NamedTuple):
    """Teacher-column gradients sorted by column: `columns`, `rows` (int64) and `values`
    (fp32), `[E]` each, `E = N K` (a not-owned entry has the value 0)."""

    columns: Tensor
    rows: Tensor
    values: Tensor


def column_entries(index: Tensor, owned: Tensor | None, values: Tensor) -> ColumnEntries:
    """Every entry of `values` `[N, K]` at local columns `index` `[N, K]` (value 0 where not
    `owned`), sorted by column (stably: each column's entries in row order)."""
    if owned is not None:
        values = torch.where(
            owned, values, torch.zeros((), dtype=values.dtype, device=values.device)
        )
    rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1).expand_as(index)
    columns = index.reshape(-1).long()
    order = torch.argsort(columns, stable=True)
    return ColumnEntries(columns[order], rows.reshape(-1)[order], values.reshape(-1)[order])


class ColumnBatch(NamedTuple):
    """One batch of `column_sums`, `[B]` slots: slot `s` holds `columns[s]`'s whole fp32 sum
    `sums[s]` (`[B, H]`) when `complete` (a 0-dim bool, the same for every slot), and
    nothing to add otherwise. Slots that share a column carry identical values, so writing
    every slot (`index_copy_`) gives the same result in any order."""

    columns: Tensor
    sums: Tensor
    complete: Tensor


def column_sums(
    entries: ColumnEntries, hidden: Tensor, batch_entries: int
) -> Iterator[ColumnBatch]:
    """Per distinct column `c` of `entries`: `sum_e values[e] * hidden[rows[e]]` over its
    entries, in fp32, in batches of at most `batch_entries` entries (`ColumnBatch`); every
    column is complete in exactly one batch, the one holding its last entry.

    `hidden` `[N, H]` any float dtype (upcast once). `embedding_bag` (sum mode with
    per-sample weights) gathers and sums the rows of a batch in one kernel, without an
    `[E, H]` temporary.
    """
    total = entries.columns.shape[0]
    if total == 0:
        return
    table = hidden.float()
    columns, rows, values = entries
    device = columns.device
    starts = torch.ones(total, dtype=torch.bool, device=device)
    starts[1:] = columns[1:] != columns[:-1]
    segment = torch.cumsum(starts, 0)  # 1 + the segment (distinct column) of each entry
    slots = torch.arange(min(batch_entries, total), device=device)
    carry = table.new_zeros(table.shape[1])
    for first in range(0, total, batch_entries):
        last = min(first + batch_entries, total)
        local = segment[first:last] - segment[first]  # [n], 0-based, non-decreasing
        n = last - first
        offsets = torch.searchsorted(local, slots[:n])  # bag i starts there (n: empty)
        sums = F.embedding_bag(
            rows[first:last], table, offsets, mode="sum", per_sample_weights=values[first:last]
        )
        if first > 0:  # the first column continues the last one of the batch before
            sums[0] += torch.where(columns[first] == columns[first - 1], carry, 0.0)
        used = local[-1]  # the batch's last segment
        if last < total:
            continues = (columns[last] == columns[last - 1]).long()
            carry = sums.index_select(0, used.reshape(1)).reshape(-1)
        else:
            continues = torch.zeros((), dtype=torch.long, device=device)
        ready = used - continues  # the last segment whose sum is whole here (-1: none)
        source = torch.minimum(slots[:n], ready).clamp_min(0)
        segment_columns = columns[first:last].gather(0, offsets.clamp_max(n - 1))
        yield ColumnBatch(
            columns=segment_columns.index_select(0, source),
            sums=sums.index_select(0, source),
            complete=ready >= 0,
        )


def add_column_sums_(
    grad_weight: Tensor,
    entries: ColumnEntries,
    hidden: Tensor,
    batch_entries: int,
    compensation: Tensor | None = None,
) -> None:
    """In place: `grad_weight[c]` `[V_local, H]` <- `grad_weight[c] (+ compensation[c]) +
    column sum c` for every column of `entries`, added in fp32 and rounded once to
    `grad_weight`'s dtype; `compensation[c]` (hi + lo's low part) <- 0 where added."""
    dtype = grad_weight.dtype
    for batch in column_sums(entries, hidden, batch_entries):
        current = grad_weight.index_select(0, batch.columns).float()
        added = batch.sums
        if compensation is not None:
            low = compensation.index_select(0, batch.columns).float()
            added = added + low
            kept = torch.where(batch.complete, torch.zeros_like(low), low)
            compensation.index_copy_(0, batch.columns, kept.to(compensation.dtype))
        result = torch.where(batch.complete, current + added, current)
        grad_weight.index_copy_(0, batch.columns, result.to(dtype))
