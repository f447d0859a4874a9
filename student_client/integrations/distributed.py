"""Data-parallel glue: one teacher client per rank, per-rank recordings, metrics over ranks.

Under ``torchrun`` / ``accelerate launch`` every data-parallel rank trains on its own shard
of the data and fetches the payloads of exactly its own batches through a
:class:`~student_client.clients.blocking.TeacherClient` of its own (one channel per target, with its
own prefetch window), so nothing here talks to the teacher. What the ranks must agree on:

- :func:`rank_client_options`: a recording (``record_to=``) goes to a directory per rank
  (``<record_to>/rank-00000``, ...), so no two processes write one recording;
- :func:`rank_recordings` / :func:`recorded_dataset`: those directories back as one
  dataset, which ``torch.utils.data.DistributedSampler`` shards again for replay;
- :func:`mean_over_ranks`: loss statistics (``kd_*``) averaged over the ranks for logging,
  in one all-reduce (the losses reduce nothing over data-parallel ranks: their gradient
  is the rank's own, averaged by DDP / FSDP).

docs/scaling.md has the commands for each setup.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset

from student_client.offline.dataset import PayloadDataset
from topk_protocol.storage import join

__all__ = [
    "RANK_DIR_FORMAT",
    "data_parallel_rank",
    "mean_over_ranks",
    "rank_client_options",
    "rank_recordings",
    "recorded_dataset",
]

RANK_DIR_FORMAT = "rank-{rank:05d}"
"""Sub-directory of a recording written by data-parallel rank ``rank``."""


def data_parallel_rank(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from the initialised default process group
    (or ``group``), else the launcher's ``RANK`` / ``WORLD_SIZE``, else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_client_options(
    options: Mapping[str, Any] | None, rank: int, world_size: int
) -> dict[str, Any]:
    """``TeacherClient`` options for data-parallel rank ``rank``: with ``world_size > 1`` a
    ``record_to`` directory becomes ``record_to / RANK_DIR_FORMAT`` (one recording per
    rank); everything else is unchanged. One process: the options as given."""
    result = dict(options or {})
    record_to = result.get("record_to")
    if record_to is not None and world_size > 1:
        result["record_to"] = join(record_to, RANK_DIR_FORMAT.format(rank=rank))
    return result


def rank_recordings(path: str | Path) -> list[Path]:
    """The per-rank recordings under ``path`` in rank order, or ``[path]`` when ``path`` is
    one recording (a one-process run).

    Raises:
        FileNotFoundError: ``path`` holds neither.
    """
    root = Path(path)
    ranks = sorted(p for p in root.glob(RANK_DIR_FORMAT.replace("{rank:05d}", "*")) if p.is_dir())
    if ranks:
        return ranks
    if (root / "metadata.json").exists():
        return [root]
    raise FileNotFoundError(f"path: {root} holds no recording and no {RANK_DIR_FORMAT} dirs")


def recorded_dataset(path: str | Path, **options: Any) -> ConcatDataset[Any]:
    """Every rank's recording under ``path`` as one dataset (rank 0's rows first): items as
    :class:`~student_client.offline.dataset.PayloadDataset`'s, ``options`` passed to each.
    Shard it for replay with ``DistributedSampler`` like any dataset."""
    return ConcatDataset([PayloadDataset(p, **options) for p in rank_recordings(path)])


def mean_over_ranks(
    metrics: Mapping[str, float | torch.Tensor], group: Any = None
) -> dict[str, float]:
    """The mean of each metric over the ranks of ``group`` (default: every rank), with one
    all-reduce of a float64 vector; identity without an initialised process group.

    Every rank must call it with the same names in the same order (a collective)."""
    names = list(metrics)
    values = torch.tensor([float(metrics[n]) for n in names], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
            values = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
        values = values.cpu() / dist.get_world_size(group)
    return dict(zip(names, values.tolist(), strict=True))
