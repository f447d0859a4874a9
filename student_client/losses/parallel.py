"""Vocab sharding: which columns a rank owns, and the few collectives the loss needs.

A `VocabShard` describes rank `r` of a process group whose ranks hold consecutive slices of
the vocabulary in rank order: rank `r` holds global ids `[r * V_local, (r + 1) * V_local)`.
Without a process group it is the whole vocabulary and every collective is a no-op, so the
chunked loss has one code path for both cases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["VocabShard", "gather_columns", "put_columns"]


@dataclass(frozen=True)
class VocabShard:
    """One rank's slice of the vocabulary.

    Attributes:
        group: the process group (None: single process, the slice is the whole vocabulary).
        rank: this rank's index in `group` (0 without a group).
        world_size: number of ranks in `group` (1 without a group).
        local_vocab: `V_local`, the number of vocabulary columns on each rank.
        global_vocab: the whole vocabulary's size, `V_local * world_size` (derived).
    """

    group: Any
    rank: int
    world_size: int
    local_vocab: int
    global_vocab: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_vocab", self.local_vocab * self.world_size)

    @classmethod
    def from_group(cls, group: Any, local_vocab: int) -> VocabShard:
        """The shard of the calling rank in `group` (None: the whole vocabulary)."""
        if group is None:
            return cls(group=None, rank=0, world_size=1, local_vocab=local_vocab)
        return cls(
            group=group,
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            local_vocab=local_vocab,
        )

    @property
    def start(self) -> int:
        """First global id held by this rank (`v0`)."""
        return self.rank * self.local_vocab

    @property
    def is_sharded(self) -> bool:
        """True when collectives are needed (a process group is given)."""
        return self.group is not None

    def localize(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """Global ids `[N, K]` -> local column index `[N, K]` int64 and ownership mask.

        Returns `(index, owned)`: `owned` is a bool `[N, K]` mask of the ids that fall in this
        rank's slice (None when unsharded: every id is local). `index` holds the local column
        for owned ids and 0 elsewhere, so it is always a valid column to gather from.
        """
        index = ids.to(torch.int64)
        if not self.is_sharded:
            return index, None
        index = index - self.start
        owned = (index >= 0) & (index < self.local_vocab)
        return torch.where(owned, index, torch.zeros_like(index)), owned

    def all_reduce_max_(self, tensor: Tensor) -> Tensor:
        """In-place element-wise MAX over the group; `tensor` must be contiguous."""
        if self.is_sharded:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def all_reduce_sum_(self, tensor: Tensor) -> Tensor:
        """In-place element-wise SUM over the group; `tensor` must be contiguous."""
        if self.is_sharded:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_columns(self, tensor: Tensor) -> Tensor:
        """`[n, c]` on every rank -> `[n, c * world_size]`, the ranks' blocks side by side."""
        if not self.is_sharded:
            return tensor
        tensor = tensor.contiguous()
        blocks = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(blocks, tensor, group=self.group)
        return torch.cat(blocks, dim=1)


def gather_columns(source: Tensor, index: Tensor, owned: Tensor | None) -> Tensor:
    """Values of `source` `[n, V_local]` at columns `index` `[n, K]`; 0 where not `owned`.

    Returns `[n, K]` in `source`'s dtype. `owned` None means every column is local.
    """
    values = source.gather(1, index)
    if owned is None:
        return values
    return torch.where(owned, values, torch.zeros((), dtype=values.dtype, device=values.device))


def put_columns(target: Tensor, index: Tensor, owned: Tensor | None, values: Tensor) -> None:
    """Overwrite `target` `[n, V_local]` at columns `index` `[n, K]` with `values` `[n, K]`.

    Only owned entries are written (`owned` None: all). Indices must be distinct within a
    row among the owned entries (teacher ids are checked for duplicates upstream); not-owned
    entries point at column 0 and may repeat, so they are written as "multiply by 1, add 0",
    which leaves that column exactly as it was whatever the order.

    `target` should be float32/float64: on CPU, scattering into bfloat16 makes a float32
    copy of the whole target.
    """
    if owned is None:
        target.scatter_(1, index, values)
        return
    keep = (~owned).to(target.dtype)
    target.scatter_reduce_(1, index, keep, reduce="prod")
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    target.scatter_add_(1, index, torch.where(owned, values, zero).to(target.dtype))
