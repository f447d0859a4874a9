"""Vocab-parallel loss on real gloo process groups (2 and 4 CPU processes, spawned).

Every rank builds the same full problem, keeps its vocab shard of the logits, and checks the
sharded loss, stats and gradient shard against the single-process result of the full
logits. Spawning dominates the cost, so each process group runs many checks and reports
how many passed; the test then asserts every rank reported all of them.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from student_client.losses import topk_kl_loss

SCENARIOS: list[dict[str, Any]] = [
    {"mode": "tail", "chunk_size": 1},
    {"mode": "truncated", "chunk_size": None},
    {"mode": "tail", "temperature": 0.7, "chunk_size": 4},
    {"mode": "truncated", "clamp_min": 0.0, "chunk_size": 4},
    {"mode": "tail", "reduction": "none", "chunk_size": None},
    {"mode": "truncated", "reduction": "sum", "temperature": 1.3, "chunk_size": 6},
]
SHAPES = [
    # (positions, local vocab, K): K > V_local makes the student's top-k span shards.
    ((3, 5), 7, 5),
    ((11,), 3, 5),
]
DTYPES = [torch.float32, torch.bfloat16]


def _problem(
    positions: tuple[int, ...], vocab: int, top_k: int, world: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full logits `[..., V]`, ids and log-probs `[..., K]`, mask `[...]`, same on every rank.

    The first positions' ids are the shard borders `v0` and `v1 - 1` of every rank.
    """
    generator = torch.Generator().manual_seed(vocab * 100 + top_k)
    n_rows = int(torch.tensor(positions).prod())
    local_vocab = vocab // world
    logits = torch.randn(n_rows, vocab, generator=generator) * 3
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:top_k] for _ in range(n_rows)])
    borders = sorted(
        {b for r in range(world) for b in (r * local_vocab, (r + 1) * local_vocab - 1)}
    )
    for row, start in enumerate(range(0, len(borders), top_k)):
        chosen = borders[start : start + top_k]
        rest = [i for i in torch.randperm(vocab, generator=generator).tolist() if i not in chosen]
        ids[row] = torch.tensor((chosen + rest)[:top_k])
    logprobs = torch.log_softmax(torch.randn(n_rows, vocab, generator=generator) * 2, -1)
    logprobs = logprobs.gather(1, ids)
    mask = torch.rand(n_rows, generator=generator) > 0.25
    mask[0] = True
    return (
        logits.reshape(*positions, vocab).to(dtype),
        ids.reshape(*positions, top_k).int(),
        logprobs.reshape(*positions, top_k),
        mask.reshape(positions),
    )


def _loss_grad(logits: torch.Tensor, *args: Any, **kwargs: Any):
    leaf = logits.detach().clone().requires_grad_(True)
    loss, stats = topk_kl_loss(leaf, *args, **kwargs)
    loss.sum().backward()
    assert leaf.grad is not None
    return loss.detach(), stats, leaf.grad


def _check_rank(rank: int, world: int) -> int:
    """Run every scenario on this rank; return the number of checks that passed."""
    group = dist.group.WORLD
    passed = 0
    for (positions, local_vocab, top_k), dtype, scenario in itertools.product(
        SHAPES, DTYPES, SCENARIOS
    ):
        vocab = local_vocab * world
        logits, ids, logprobs, mask = _problem(positions, vocab, top_k, world, dtype)
        shard = logits[..., rank * local_vocab : (rank + 1) * local_vocab].contiguous()
        want_loss, want_stats, want_grad = _loss_grad(logits, ids, logprobs, mask=mask, **scenario)
        loss, stats, grad = _loss_grad(
            shard, ids, logprobs, mask=mask, process_group=group, **scenario
        )
        label = f"rank {rank}/{world} {positions} V_local={local_vocab} {dtype} {scenario}"

        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7, msg=label)
        for name, value in stats.as_dict().items():
            assert value == pytest.approx(want_stats.as_dict()[name], rel=1e-6, abs=1e-7), (
                label,
                name,
            )
        # bf16: fp32 sums in another order may round a gradient entry to the next bf16.
        rtol, atol = (8e-3, 1e-6) if dtype == torch.bfloat16 else (1e-5, 1e-7)
        want_shard = want_grad[..., rank * local_vocab : (rank + 1) * local_vocab]
        torch.testing.assert_close(grad, want_shard, rtol=rtol, atol=atol, msg=label)

        everyone = [torch.empty_like(loss) for _ in range(world)]
        dist.all_gather(everyone, loss.contiguous(), group=group)
        assert all(torch.equal(other, loss) for other in everyone), label
        passed += 1
    return passed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        passed = _check_rank(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"passed": passed}))


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_single_process(world: int, tmp_path: Path) -> None:
    init_file = tmp_path / "rendezvous"
    mp.spawn(_worker, args=(world, str(init_file), str(tmp_path)), nprocs=world, join=True)
    expected = len(SHAPES) * len(DTYPES) * len(SCENARIOS)
    reports = {
        rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)
    }
    assert reports == {rank: {"passed": expected} for rank in range(world)}


def test_vocab_parallel_rejects_ids_beyond_global_vocabulary(tmp_path: Path) -> None:
    # A single-rank group: the global vocabulary is V_local * 1; the check uses the group.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        logits = torch.randn(2, 5)
        ids = torch.tensor([[0, 5], [1, 2]])
        with pytest.raises(ValueError, match=r"^teacher_ids: ids must lie in \[0, 5\)"):
            topk_kl_loss(logits, ids, torch.full((2, 2), -1.0), process_group=dist.group.WORLD)
        loss, _ = topk_kl_loss(
            logits, ids.clamp_max(4), torch.full((2, 2), -1.0), process_group=dist.group.WORLD
        )
        want, _ = topk_kl_loss(logits, ids.clamp_max(4), torch.full((2, 2), -1.0))
        assert torch.equal(loss, want)
    finally:
        dist.destroy_process_group()
