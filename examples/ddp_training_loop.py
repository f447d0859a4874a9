"""The training loop under data parallelism: plain PyTorch DDP, one teacher client per rank.

    torchrun --nproc-per-node 2 -m examples.ddp_training_loop --teacher 127.0.0.1:50051
    torchrun --nproc-per-node 2 -m examples.ddp_training_loop --teacher 127.0.0.1:50051 \\
        --record runs/ddp                # rank r records to runs/ddp/rank-0000r
    torchrun --nproc-per-node 2 -m examples.ddp_training_loop --replay runs/ddp

Every rank reads its own shard of the data (``DistributedSampler``), opens its own
``TeacherClient`` (its own channel and prefetch window: ``--depth`` requests in flight per
rank), trains the same :class:`~examples.training_loop.ToyStudent` wrapped in
``DistributedDataParallel`` (which averages the gradients over the ranks), and logs the
loss statistics averaged over the ranks (rank 0 prints). One process (``python -m``) is
the same loop with world size 1. docs/scaling.md explains the setup.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from examples.training_loop import ToyStudent
from student_client.integrations.distributed import (
    data_parallel_rank,
    mean_over_ranks,
    rank_client_options,
    rank_recordings,
)
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss

__all__ = ["main", "rank_batches", "train", "window_dataset"]


def window_dataset(n: int, seq_len: int, vocab_size: int, seed: int = 0) -> TensorDataset:
    """``n`` random token windows ``[seq_len]`` (a stand-in for a tokenised corpus)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, vocab_size, (n, seq_len), generator=g))


def rank_batches(
    data: TensorDataset, batch_size: int, rank: int, world_size: int
) -> Iterator[torch.Tensor]:
    """Rank ``rank``'s batches ``[batch_size, T]``: its ``DistributedSampler`` shard, in
    order. Step ``s`` of all ranks together is rows ``[s * B * W, (s + 1) * B * W)``: the
    global batch one process with batch ``B * W`` trains on at step ``s``."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=False
    )
    for (x,) in DataLoader(data, batch_size=batch_size, sampler=sampler):
        yield x


def train(
    client: Any,
    *,
    steps: int = 20,
    batch_size: int = 4,
    seq_len: int = 64,
    top_k: int = 16,
    depth: int = 4,
    lr: float = 1e-2,
    seed: int = 0,
    quiet: bool = False,
) -> dict[str, Any]:
    """``steps`` DDP steps of a :class:`ToyStudent` (``batch_size`` per rank).

    Returns ``{"losses": [...] (this rank's), "logged": [...] (means over the ranks),
    "step_seconds": [...] (wall time of each step, payload wait included), "state": the
    student's final state dict}``."""
    rank, world = data_parallel_rank()
    vocab_size = client.info().vocab_size
    torch.manual_seed(seed)  # the same initial student on every rank
    student = ToyStudent(vocab_size)
    model = DistributedDataParallel(student) if world > 1 else student
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = window_dataset(steps * batch_size * world, seq_len, vocab_size, seed)
    to_student, to_teacher = itertools.tee(rank_batches(data, batch_size, rank, world))
    payloads = client.stream(to_teacher, top_k, depth=depth)  # this rank's prefetch window
    losses, logged, step_seconds = [], [], []
    start = time.perf_counter()
    for step, (x, payload) in enumerate(zip(to_student, payloads, strict=True)):
        teacher = TeacherTargets.from_payload(payload)  # ids, log-probs, mask: [B, T, K]
        loss, stats = topk_kl_loss(model(x), teacher, LossOptions(mode="tail"))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP: gradients averaged over the ranks here
        opt.step()
        losses.append(loss.item())
        means = mean_over_ranks({"loss": losses[-1], "teacher_mass": stats.teacher_mass})
        logged.append(means)
        step_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        if rank == 0 and not quiet:
            print(
                f"step {step}  loss {means['loss']:.4f}  teacher mass {means['teacher_mass']:.3f}"
            )
    return {
        "losses": losses,
        "logged": logged,
        "step_seconds": step_seconds,
        "state": student.state_dict(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--teacher", help="teacher target, host:port")
    source.add_argument("--replay", type=Path, help="a --record directory: replay per rank")
    ap.add_argument("--record", type=Path, help="record each rank's payloads under this dir")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--out", type=Path, help="write this rank's results here (.pt, .json)")
    args = ap.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = data_parallel_rank()
    try:
        if args.replay is not None:
            from student_client.offline.replay_client import ReplayClient

            client: Any = ReplayClient(rank_recordings(args.replay)[rank])
        else:
            from student_client.clients.blocking import TeacherClient

            options = rank_client_options({"record_to": args.record}, rank, world)
            client = TeacherClient(args.teacher, **options)
        with client:
            result = train(
                client,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                top_k=args.top_k,
                depth=args.depth,
            )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(result["state"], args.out / f"rank{rank}.pt")
            summary = {k: result[k] for k in ("losses", "logged", "step_seconds")}
            (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        if distributed:
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
