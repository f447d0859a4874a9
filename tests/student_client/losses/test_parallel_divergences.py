"""Every divergence x mode vocab-parallel on real gloo process groups (2 and 4 spawned CPU
processes), logits and fused paths, against the single-process result (as
`test_parallel.py` does for the forward KL's options). The actual tokens include
ids at the shard borders, ids inside the top-k and rows without a next token."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from coarse_oracle import DIVERGENCE_CASES, MODES_OF
from test_parallel import _fused_loss_grads, _loss_grad, _problem

from student_client.losses import (
    get_divergence,
)

SHAPES = [((3, 5), 7, 5), ((11,), 3, 5)]
DTYPES = [torch.float32, torch.bfloat16]
SCENARIOS: list[dict[str, Any]] = [
    {"chunk_size": 1, "overlap": True},
    {"chunk_size": 4, "temperature": 0.7, "reduction": "sum"},
    {"chunk_size": None, "reduction": "none", "validate": False},
]
CASES = [(name, params, mode) for name, params in DIVERGENCE_CASES for mode in MODES_OF[name]]
CASES = [case for case in CASES if case[2] != "truncated"]  # covered by test_parallel
HIDDEN = 6


def _actual(ids: torch.Tensor, logprobs: torch.Tensor, vocab: int, world: int):
    """Actual tokens `[...]`: shard borders first, then a teacher id, then random ids; the
    last position has none (NaN)."""
    positions = ids.shape[:-1]
    n_rows = int(torch.tensor(positions).prod())
    generator = torch.Generator().manual_seed(vocab)
    local = vocab // world
    borders = [b for r in range(world) for b in (r * local, (r + 1) * local - 1)]
    sampled = torch.randint(0, vocab, (n_rows,), generator=generator)
    sampled[: len(borders)] = torch.tensor(borders)[:n_rows]
    flat_ids = ids.reshape(n_rows, -1)
    sampled[min(len(borders), n_rows - 2)] = flat_ids[min(len(borders), n_rows - 2), 0]
    log = torch.log(torch.rand(n_rows, generator=generator) * 0.05)
    log[-1] = math.nan
    return {"sampled_ids": sampled.reshape(positions), "sampled_logprobs": log.reshape(positions)}


def _check(rank: int, world: int) -> tuple[int, int]:
    group = dist.group.WORLD
    passed = fused_passed = 0
    for (positions, local_vocab, top_k), dtype, scenario, (name, params, mode) in itertools.product(
        SHAPES, DTYPES, SCENARIOS, CASES
    ):
        vocab = local_vocab * world
        logits, ids, logprobs, mask = _problem(positions, vocab, top_k, world, dtype)
        options = {
            **scenario,
            "divergence": get_divergence(name, **params),
            "mode": mode,
            **(_actual(ids, logprobs, vocab, world) if mode == "tail_actual" else {}),
        }
        label = f"rank {rank}/{world} {positions} {dtype} {name} {mode} {scenario}"
        columns = slice(rank * local_vocab, (rank + 1) * local_vocab)
        want_loss, want_stats, want_grad = _loss_grad(logits, ids, logprobs, mask=mask, **options)
        loss, stats, grad = _loss_grad(
            logits[..., columns].contiguous(),
            ids,
            logprobs,
            mask=mask,
            process_group=group,
            **options,
        )
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7, msg=label)
        for key, value in stats.as_dict().items():
            assert value == pytest.approx(
                want_stats.as_dict()[key], rel=1e-6, abs=1e-7, nan_ok=True
            ), (label, key)
        # fp32: the reverse KL's coefficients hold log q̂ - log p̂ - D, from sums taken in
        # another order over the shards: a few 1e-5 relative at most.
        rtol, atol = (8e-3, 1e-6) if dtype == torch.bfloat16 else (5e-5, 1e-6)
        torch.testing.assert_close(grad, want_grad[..., columns], rtol=rtol, atol=atol, msg=label)
        passed += 1

        generator = torch.Generator().manual_seed(vocab + top_k)
        hidden = torch.randn(*positions, HIDDEN, generator=generator).to(dtype)
        weight = torch.randn(vocab, HIDDEN, generator=generator).to(dtype)
        bias = torch.randn(vocab, generator=generator).to(dtype)
        want_loss, want_stats, want = _fused_loss_grads(
            hidden, weight, bias, ids, logprobs, mask=mask, **options
        )
        loss, stats, got = _fused_loss_grads(
            hidden,
            weight[columns].contiguous(),
            bias[columns].contiguous(),
            ids,
            logprobs,
            mask=mask,
            process_group=group,
            **options,
        )
        rel, abs_ = (1e-3, 1e-4) if dtype == torch.bfloat16 else (1e-5, 1e-6)
        torch.testing.assert_close(loss, want_loss, rtol=rel, atol=abs_, msg=label)
        for key, value in stats.as_dict().items():
            assert value == pytest.approx(
                want_stats.as_dict()[key], rel=rel, abs=abs_, nan_ok=True
            ), (label, key)
        # The shard's logits come from another matmul call (other fp32 blocking); the
        # reverse KL's and the JSD's gradients hold log-ratios that move with them.
        rtol, atol = (2e-2, 2e-3) if dtype == torch.bfloat16 else (5e-5, 1e-5)
        for grad, reference in zip(got, [want[0], want[1][columns], want[2][columns]], strict=True):
            scale = float(reference.abs().max())
            torch.testing.assert_close(grad, reference, rtol=rtol, atol=atol * scale, msg=label)
        fused_passed += 1
    return passed, fused_passed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        passed, fused_passed = _check(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([passed, fused_passed]))


@pytest.mark.parametrize("world", [2, 4])
def test_every_divergence_vocab_parallel(world: int, tmp_path: Path) -> None:
    mp.spawn(
        _worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world, join=True
    )
    expected = len(SHAPES) * len(DTYPES) * len(SCENARIOS) * len(CASES)
    for rank in range(world):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [expected, expected]
