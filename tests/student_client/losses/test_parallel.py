"""Vocab-parallel loss on real gloo process groups (2 and 4 CPU processes, spawned).

Every rank builds the same full problem, keeps its vocab shard of the logits (or, for the
fused loss, of the lm_head weight and bias), and checks the sharded loss, stats and
gradients against the single-process result of the full problem: the logits' gradient
shard; for the fused loss the full `grad_hidden` and the rank's `grad_weight` / `grad_bias`
shards. Spawning dominates the cost, so each process group runs many checks and reports
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

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from tests.student_client.losses.calls import teacher_and_options

SCENARIOS: list[dict[str, Any]] = [
    {"mode": "tail", "chunk_size": 1, "overlap": True},
    {"mode": "truncated", "chunk_size": None, "overlap": True},
    {"mode": "tail", "temperature": 0.7, "chunk_size": 4, "overlap": True},
    {"mode": "truncated", "clamp_min": 0.0, "chunk_size": 4, "validate": False},
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
    loss, stats = topk_kl_loss(leaf, *teacher_and_options(*args, **kwargs))
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
            want_value = want_stats.as_dict()[name]
            assert value == pytest.approx(want_value, rel=1e-6, abs=1e-7, nan_ok=True), (
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


FUSED_SCENARIOS: list[dict[str, Any]] = [
    {"mode": "tail", "chunk_size": 1},
    {"mode": "truncated", "reduction": "sum", "clamp_min": 0.0, "chunk_size": 4},
    {"mode": "tail", "reduction": "none", "temperature": 0.7, "chunk_size": None},
    {"mode": "tail", "grad_in_forward": False, "chunk_size": 6, "overlap": True},
]
HIDDEN = 6


def _fused_loss_grads(hidden, weight, bias, *args: Any, **kwargs: Any):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    head = (leaves[1], leaves[2])
    loss, stats = lm_head_topk_kl_loss(head, leaves[0], *teacher_and_options(*args, **kwargs))
    loss.sum().backward()
    grads = [leaf.grad for leaf in leaves]
    assert all(grad is not None for grad in grads)
    return loss.detach(), stats, grads


def _check_fused_rank(rank: int, world: int) -> int:
    """The fused loss on this rank's weight shard; returns the number of checks passed."""
    group = dist.group.WORLD
    passed = 0
    for (positions, local_vocab, top_k), dtype, scenario in itertools.product(
        SHAPES, DTYPES, FUSED_SCENARIOS
    ):
        vocab = local_vocab * world
        _, ids, logprobs, mask = _problem(positions, vocab, top_k, world, dtype)
        generator = torch.Generator().manual_seed(vocab + top_k)
        hidden = torch.randn(*positions, HIDDEN, generator=generator).to(dtype)
        weight = torch.randn(vocab, HIDDEN, generator=generator).to(dtype)
        bias = torch.randn(vocab, generator=generator).to(dtype)
        columns = slice(rank * local_vocab, (rank + 1) * local_vocab)
        want_loss, want_stats, want = _fused_loss_grads(
            hidden, weight, bias, ids, logprobs, mask=mask, **scenario
        )
        loss, stats, got = _fused_loss_grads(
            hidden,
            weight[columns].contiguous(),
            bias[columns].contiguous(),
            ids,
            logprobs,
            mask=mask,
            process_group=group,
            **scenario,
        )
        label = f"fused rank {rank}/{world} {positions} V_local={local_vocab} {dtype} {scenario}"
        # The shard's logits come from another matmul call than the full ones (other
        # blocking): fp32 rounding differs in the last bits, and bf16 may round a logit
        # to the neighbouring value.
        rel, abs_ = (1e-3, 1e-4) if dtype == torch.bfloat16 else (1e-5, 1e-6)
        torch.testing.assert_close(loss, want_loss, rtol=rel, atol=abs_, msg=label)
        for name, value in stats.as_dict().items():
            assert value == pytest.approx(
                want_stats.as_dict()[name], rel=rel, abs=abs_, nan_ok=True
            ), (label, name)
        # bf16: the logits block and the products are rounded to bf16 (sums in other orders).
        rtol, atol = (2e-2, 2e-3) if dtype == torch.bfloat16 else (1e-5, 1e-6)
        expected = [want[0], want[1][columns], want[2][columns]]
        for name, grad, reference in zip(("hidden", "weight", "bias"), got, expected, strict=True):
            scale = float(reference.abs().max())
            torch.testing.assert_close(
                grad, reference, rtol=rtol, atol=atol * scale, msg=f"{label} grad_{name}"
            )
        # grad_hidden is already the sum over the shards: identical on every rank.
        everyone = [torch.empty_like(got[0]) for _ in range(world)]
        dist.all_gather(everyone, got[0].contiguous(), group=group)
        assert all(torch.equal(other, got[0]) for other in everyone), label
        passed += 1
    return passed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        passed = _check_rank(rank, world)
        fused_passed = _check_fused_rank(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report = {"passed": passed, "fused_passed": fused_passed}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_single_process(world: int, tmp_path: Path) -> None:
    init_file = tmp_path / "rendezvous"
    mp.spawn(_worker, args=(world, str(init_file), str(tmp_path)), nprocs=world, join=True)
    expected = {
        "passed": len(SHAPES) * len(DTYPES) * len(SCENARIOS),
        "fused_passed": len(SHAPES) * len(DTYPES) * len(FUSED_SCENARIOS),
    }
    reports = {
        rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)
    }
    assert reports == dict.fromkeys(range(world), expected)


def test_vocab_parallel_rejects_ids_beyond_global_vocabulary(tmp_path: Path) -> None:
    # A single-rank group: the global vocabulary is V_local * 1; the check uses the group.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        logits = torch.randn(2, 5)
        ids = torch.tensor([[0, 5], [1, 2]])
        with pytest.raises(ValueError, match=r"^teacher\.ids: ids must lie in \[0, 5\)"):
            topk_kl_loss(
                logits,
                TeacherTargets(ids, torch.full((2, 2), -1.0)),
                LossOptions(process_group=dist.group.WORLD),
            )
        loss, _ = topk_kl_loss(
            logits,
            TeacherTargets(ids.clamp_max(4), torch.full((2, 2), -1.0)),
            LossOptions(process_group=dist.group.WORLD),
        )
        want, _ = topk_kl_loss(logits, TeacherTargets(ids.clamp_max(4), torch.full((2, 2), -1.0)))
        assert torch.equal(loss, want)
    finally:
        dist.destroy_process_group()
