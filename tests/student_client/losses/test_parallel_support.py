"""The three supports x three divergences vocab-parallel on real gloo process groups (2 and
4 spawned CPU processes), logits path (`topk_kl_loss`) and fused path (`lm_head_topk_kl_loss`
on a vocabulary-sharded lm_head), against the float64 dense reference (`reference.py`) of
the whole problem: loss and each rank's gradient shard (`grad_hidden` in full). Candidates
include the shard borders, padded rows and repeats (`support_cases.py`). One spawn per
world size runs every case."""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from coarse_oracle import DIVERGENCE_CASES
from support_cases import SUPPORTS, make_candidates

from student_client.losses import (
    get_divergence,
    lm_head_topk_kl_loss,
    topk_kl_loss,
    topk_kl_reference,
)
from tests.student_client.losses.calls import teacher_and_options

POSITIONS, LOCAL_VOCAB, TOP_K, WIDTH, HIDDEN = (3, 5), 7, 5, 6, 6
SCENARIOS: list[dict[str, Any]] = [
    {"dtype": torch.float32, "mode": "tail", "temperature": 0.7, "chunk_size": 4},
    {
        "dtype": torch.bfloat16,
        "mode": "tail_actual",
        "reduction": "sum",
        "chunk_size": None,
        "validate": False,
    },
]
CASES = list(itertools.product(SCENARIOS, DIVERGENCE_CASES, SUPPORTS))


def _problem(world: int) -> dict[str, torch.Tensor]:
    """The whole problem, the same on every rank: float64 logits, a teacher top-k with the
    shard borders among the first rows' ids, candidates with the borders too, actual
    tokens (NaN at the last position), a mask."""
    vocab = LOCAL_VOCAB * world
    n_rows = math.prod(POSITIONS)
    generator = torch.Generator().manual_seed(world)
    logits = torch.randn(n_rows, vocab, generator=generator, dtype=torch.float64) * 3
    teacher = torch.log_softmax(torch.randn(n_rows, vocab, generator=generator) * 2, -1).double()
    borders = sorted(
        {b for r in range(world) for b in (r * LOCAL_VOCAB, (r + 1) * LOCAL_VOCAB - 1)}
    )
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:TOP_K] for _ in range(n_rows)])
    for row, start in enumerate(range(0, len(borders), TOP_K)):
        chosen = borders[start : start + TOP_K]
        rest = [i for i in torch.randperm(vocab, generator=generator).tolist() if i not in chosen]
        ids[row] = torch.tensor((chosen + rest)[:TOP_K])
    candidates, candidate_logprobs = make_candidates(logits, ids, teacher, WIDTH, seed=world)
    for row in range(n_rows):  # a shard border among every non-padded row's candidates
        if candidates[row, 0] >= 0:
            candidates[row, 0] = borders[(row + 1) % len(borders)]
    candidate_logprobs = torch.where(
        candidates >= 0, teacher.gather(1, candidates.clamp_min(0)), math.nan
    )
    sampled = torch.randint(0, vocab, (n_rows,), generator=generator)
    sampled[: len(borders)] = torch.tensor(borders)[:n_rows]
    sampled[1::4] = candidates[1::4, 1].clamp_min(0)  # some inside the candidates
    sampled_logprobs = teacher.gather(1, sampled.unsqueeze(-1))[:, 0]
    sampled_logprobs[-1] = math.nan
    mask = torch.rand(n_rows, generator=generator) > 0.2
    mask[0] = True
    flat = {
        "logits": logits,
        "ids": ids,
        "logprobs": teacher.gather(1, ids),
        "candidate_ids": candidates,
        "candidate_logprobs": candidate_logprobs,
        "sampled_ids": sampled,
        "sampled_logprobs": sampled_logprobs,
        "mask": mask,
    }
    return {key: value.reshape(*POSITIONS, *value.shape[1:]) for key, value in flat.items()}


def _reduce(rows: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    kept = rows * mask.double()
    return kept.sum() if reduction == "sum" else kept.sum() / mask.double().sum()


def _reference(
    problem: dict[str, torch.Tensor], logits64: torch.Tensor, *, reduction: str, **options: Any
) -> torch.Tensor:
    """The float64 reference of the whole problem, reduced like the loss."""
    rows = topk_kl_reference(
        logits64, *teacher_and_options(problem["ids"], problem["logprobs"], **options)
    )
    return _reduce(rows.loss, problem["mask"], reduction)


def _check(rank: int, world: int) -> int:
    group = dist.group.WORLD
    problem = _problem(world)
    columns = slice(rank * LOCAL_VOCAB, (rank + 1) * LOCAL_VOCAB)
    passed = 0
    for scenario, (name, params), support in CASES:
        dtype = scenario["dtype"]
        options = {key: value for key, value in scenario.items() if key != "dtype"}
        mode, reduction = options["mode"], options.get("reduction", "mean")
        temperature = options.get("temperature", 1.0)
        divergence = get_divergence(name, **params)
        extra = {}
        if support != "teacher":
            extra = {k: problem[k] for k in ("candidate_ids", "candidate_logprobs")}
        if mode == "tail_actual":
            extra.update({k: problem[k] for k in ("sampled_ids", "sampled_logprobs")})
        label = f"rank {rank}/{world} {dtype} {name} {support} {options}"

        reference = functools.partial(
            _reference,
            problem,
            reduction=reduction,
            mode=mode,
            temperature=temperature,
            divergence=divergence,
            support=support,
            **extra,
        )

        # Logits path: this rank's shard of the (rounded) logits.
        logits = problem["logits"].to(dtype)
        want_leaf = logits.double().requires_grad_(True)
        want = reference(want_leaf)
        want.backward()
        leaf = logits[..., columns].contiguous().requires_grad_(True)
        loss, _ = topk_kl_loss(
            leaf,
            *teacher_and_options(
                problem["ids"],
                problem["logprobs"],
                mask=problem["mask"],
                process_group=group,
                divergence=divergence,
                support=support,
                **options,
                **extra,
            ),
        )
        loss.backward()
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-7, msg=label)
        scale = float(want_leaf.grad.abs().max())
        torch.testing.assert_close(
            leaf.grad.double(),
            want_leaf.grad[..., columns],
            rtol=rtol,
            atol=1e-6 * scale,
            msg=label,
        )

        # Fused path: an lm_head holding this rank's rows of the weight.
        generator = torch.Generator().manual_seed(world + passed)
        hidden = torch.randn(*POSITIONS, HIDDEN, generator=generator).to(dtype)
        weight = torch.randn(LOCAL_VOCAB * world, HIDDEN, generator=generator).to(dtype)
        bias = torch.randn(LOCAL_VOCAB * world, generator=generator).to(dtype)
        leaves64 = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
        logits64 = leaves64[0] @ leaves64[1].T + leaves64[2]
        if dtype != torch.float32:  # the fused loss rounds its logits block once
            logits64 = logits64 + (logits64.to(dtype).double() - logits64).detach()
        want = reference(logits64)
        want.backward()
        head = torch.nn.Linear(HIDDEN, LOCAL_VOCAB, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(weight[columns])
            head.bias.copy_(bias[columns])
        hidden_leaf = hidden.clone().requires_grad_(True)
        loss, _ = lm_head_topk_kl_loss(
            head,
            hidden_leaf,
            *teacher_and_options(
                problem["ids"],
                problem["logprobs"],
                mask=problem["mask"],
                process_group=group,
                divergence=divergence,
                support=support,
                **options,
                **extra,
            ),
        )
        loss.backward()
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-7, msg=label)
        rtol, atol = (1e-4, 1e-6) if dtype == torch.float32 else (3e-2, 1e-2)
        for got, reference_grad, what in (
            (hidden_leaf.grad, leaves64[0].grad, "hidden"),
            (head.weight.grad, leaves64[1].grad[columns], "weight"),
            (head.bias.grad, leaves64[2].grad[columns], "bias"),
        ):
            scale = float(reference_grad.abs().max())
            torch.testing.assert_close(
                got.double(), reference_grad, rtol=rtol, atol=atol * scale, msg=f"{label} {what}"
            )
        passed += 1
    return passed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        passed = _check(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(passed))


@pytest.mark.parametrize("world", [2, 4])
def test_every_support_vocab_parallel(world: int, tmp_path: Path) -> None:
    mp.spawn(
        _worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world, join=True
    )
    for rank in range(world):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == len(CASES)
