"""The losses on a sharded student, real gloo process groups (spawned CPU processes).

One spawn of 4 processes runs both layouts (spawning dominates the cost).

- FSDP2 on 2 processes (ranks 0-1 and 2-3, two runs side by side): a toy student
  (embedding, one layer, lm_head) with `fully_shard` on the lm_head and the root trains
  two SGD steps with the fused loss (`lm_head_topk_kl_loss`: the loss inside the head's
  FSDP forward; its recomputing backward, so the weight is all-gathered again) and the logits
  path (`topk_kl_loss` on `lm_head(hidden)`); every gathered (`full_tensor()`) gradient
  equals that of one process computing the mean of the ranks' losses on an unsharded copy.
- The FSDP2 recipe of docs/scaling.md on a tiny Qwen2, 2 processes: fused-loss gradients
  equal one process's.
- DP 2 x TP 2 on 4 processes: the same student with its lm_head `ColwiseParallel` over the
  `tp` mesh dim and `fully_shard` over `dp`; the fused loss and the logits path get the
  local shard and the TP group.
- A bf16 mixed-precision policy on the FSDP lm_head casts the hidden states and the weight,
  never the teacher's log-probs.
- Misuse: a sharded weight handed to the loss (TP without the group, FSDP outside the
  unshard) raises a ValueError naming the fix; nothing runs a collective.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from tests.student_client.losses.calls import teacher_and_options

VOCAB, HIDDEN, BATCH, SEQ, K, STEPS, LR = 16, 8, 2, 5, 4, 2, 0.5


class ToyStudent(nn.Module):
    """`[B, T]` ids -> last hidden states `[B, T, H]`; `lm_head` `[V, H]` is applied by the
    caller (the fused loss never forms the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(x)))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, ...]:
    """Data-parallel replica `replica`'s batch of `step`: ids `[B, T]`, teacher ids and
    log-probs `[B, T, K]`, mask `[B, T]` (ragged: counted positions differ by replica)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K] for _ in range(BATCH * SEQ)])
    logprobs = torch.log_softmax(torch.randn(BATCH * SEQ, VOCAB, generator=g), -1).gather(1, ids)
    mask = torch.rand(BATCH, SEQ, generator=g) > 0.3 * (replica + 1) / 2
    mask[:, 0] = True
    return x, ids.reshape(BATCH, SEQ, K), logprobs.reshape(BATCH, SEQ, K), mask


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...], path: str, group: Any, **opts: Any):
    x, ids, logprobs, mask = batch
    hidden = model(x)
    if path == "fused":
        loss, _ = lm_head_topk_kl_loss(
            model.lm_head,
            hidden,
            *teacher_and_options(ids, logprobs, mask=mask, process_group=group, **opts),
        )
    else:
        loss, _ = topk_kl_loss(
            model.lm_head(hidden),
            TeacherTargets(ids, logprobs, mask=mask),
            LossOptions(process_group=group),
        )
    return loss


def _full(grad: Any) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _train_and_compare(
    sharded: nn.Module, reference: nn.Module, replica: int, replicas: int, path: str, tp: Any
) -> int:
    """STEPS SGD steps of both students; every step's gathered gradients must match."""
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    # The recomputing backward reads the weight again, after FSDP resharded it post-forward.
    opts = {"grad_in_forward": False} if path == "fused" else {}
    checked = 0
    for step in range(STEPS):
        _loss(sharded, _batch(replica, step), path, tp, **opts).backward()
        ref_loss = sum(_loss(reference, _batch(r, step), path, None) for r in range(replicas))
        (ref_loss / replicas).backward()
        ref_grads = dict(reference.named_parameters())
        for name, param in sharded.named_parameters():
            want = ref_grads[name].grad
            assert want is not None and param.grad is not None, name
            torch.testing.assert_close(
                _full(param.grad), want, rtol=1e-5, atol=1e-6, msg=f"{path} step {step} {name}"
            )
            checked += 1
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    return checked


def _misuse(model_fsdp_head: nn.Module, tp_head: nn.Module | None) -> list[str]:
    """Each misuse's error message (no collective runs before the error)."""
    _, ids, logprobs, mask = _batch(0, 0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN)

    errors = []
    with pytest.raises(ValueError) as e:  # FSDP: the weight outside the head's forward
        lm_head_topk_kl_loss(
            model_fsdp_head.weight, hidden, TeacherTargets(ids, logprobs, mask=mask)
        )
    errors.append(str(e.value))
    if tp_head is not None:
        with pytest.raises(ValueError) as e:  # TP: the DTensor weight, no group
            lm_head_topk_kl_loss(tp_head.weight, hidden, TeacherTargets(ids, logprobs, mask=mask))
        errors.append(str(e.value))
        with pytest.raises(ValueError) as e:  # TP head, the group forgotten
            lm_head_topk_kl_loss(tp_head, hidden, TeacherTargets(ids, logprobs, mask=mask))
        errors.append(str(e.value))
    return errors


def _run_layout(rank: int, layout: str) -> dict[str, Any]:
    """Train and compare both paths under `layout` ("fsdp": FSDP2 over rank pairs (0, 1)
    and (2, 3), two 2-process runs side by side; "fsdp_tp": dp 2 x tp 2), then misuse."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if layout == "fsdp":
        dp_mesh, tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("run", "dp"))["dp"], None
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    replica, replicas = dp_mesh.get_local_rank(), dp_mesh.size()
    tp_group = None if tp_mesh is None else tp_mesh.get_group()
    report: dict[str, Any] = {}
    for path in ("fused", "logits"):
        torch.manual_seed(0)
        reference = ToyStudent()
        sharded = copy.deepcopy(reference)
        if tp_mesh is not None:
            parallelize_module(sharded.lm_head, tp_mesh, ColwiseParallel())
        fully_shard(sharded.lm_head, mesh=dp_mesh)
        fully_shard(sharded, mesh=dp_mesh)
        report[path] = _train_and_compare(sharded, reference, replica, replicas, path, tp_group)
    tp_head = None
    if tp_mesh is not None:
        tp_head = nn.Linear(HIDDEN, VOCAB)
        parallelize_module(tp_head, tp_mesh, ColwiseParallel())
    report["errors"] = _misuse(sharded.lm_head, tp_head)
    return report


def _hf_fsdp_max_error(rank: int) -> float:
    """docs/scaling.md's FSDP2 recipe on a tiny Qwen2 (every decoder layer, the lm_head,
    the base model and the root each `fully_shard`-ed over rank pairs; the base model run
    standalone, then `lm_head_topk_kl_loss`): the largest gradient error relative to each
    parameter's largest reference gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from student_client.losses import causal_lm_hidden_and_head

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("run", "dp"))["dp"]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN * 2, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    reference = Qwen2ForCausalLM(config)
    model = copy.deepcopy(reference)
    for module in [*model.model.layers, model.lm_head, model.model, model]:
        fully_shard(module, mesh=mesh)
    x, ids, logprobs, mask = _batch(mesh.get_local_rank(), 0)
    hidden = model.model(input_ids=x).last_hidden_state
    lm_head_topk_kl_loss(model.lm_head, hidden, TeacherTargets(ids, logprobs, mask=mask))[
        0
    ].backward()
    total = torch.zeros(())
    for replica in range(mesh.size()):
        x, ids, logprobs, mask = _batch(replica, 0)
        head = causal_lm_hidden_and_head(reference, input_ids=x)
        total = (
            total
            + lm_head_topk_kl_loss(
                head.weight, head.hidden, TeacherTargets(ids, logprobs, mask=mask)
            )[0]
        )
    (total / mesh.size()).backward()
    want = dict(reference.named_parameters())
    errors = []
    for name, param in model.named_parameters():
        ref_grad = want[name].grad
        assert param.grad is not None and ref_grad is not None, name
        scale = float(ref_grad.abs().max())
        assert scale > 0, name
        errors.append(float((_full(param.grad) - ref_grad).abs().max()) / scale)
    return max(errors)


def _mixed_precision_loss_error() -> float:
    """An lm_head `fully_shard`-ed over rank pairs with a bf16 mixed-precision policy:
    `lm_head_topk_kl_loss` gets the teacher's log-probs as given (fp32; FSDP casts only
    the hidden states and the weight). Returns |loss - the loss on the bf16 hidden states
    and weight with the fp32 log-probs|: 0 here, about 1e-3 when the log-probs are cast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("run", "dp"))["dp"]
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    weight = head.weight.detach().bfloat16()
    fully_shard(head, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    _, ids, logprobs, mask = _batch(0, 0)
    logprobs = logprobs + 1e-3  # not representable in bf16
    hidden = torch.randn(BATCH, SEQ, HIDDEN)
    loss, _ = lm_head_topk_kl_loss(head, hidden, TeacherTargets(ids, logprobs, mask=mask))
    want, _ = lm_head_topk_kl_loss(
        weight, hidden.bfloat16(), TeacherTargets(ids, logprobs, mask=mask)
    )
    return float((loss.float() - want.float()).abs())


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        report: dict[str, Any] = {
            layout: _run_layout(rank, layout) for layout in ("fsdp", "fsdp_tp")
        }
        report["hf_fsdp_error"] = _hf_fsdp_max_error(rank)
        report["mixed_precision_error"] = _mixed_precision_loss_error()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every rank's report; one spawn of 4 processes (spawning dominates the cost)."""
    out = tmp_path_factory.mktemp("sharded-head")
    mp.spawn(_worker, args=(4, str(out / "rendezvous"), str(out)), nprocs=4)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


FSDP_FIX = re.compile(r"^weight: is a DTensor .*fully_shard\(lm_head\).*lm_head_topk_kl_loss")
PARAMS = len(list(ToyStudent().parameters()))


def test_fsdp2_fused_and_logits_match_one_process(reports: dict[int, dict[str, Any]]) -> None:
    for report in reports.values():
        fsdp = report["fsdp"]
        assert fsdp["fused"] == fsdp["logits"] == STEPS * PARAMS
        (fsdp_error,) = fsdp["errors"]
        assert FSDP_FIX.match(fsdp_error), fsdp_error
        assert report["hf_fsdp_error"] < 1e-5
        assert report["mixed_precision_error"] < 1e-6


def test_dp2_x_tp2_fused_and_logits_match_one_process(reports: dict[int, dict[str, Any]]) -> None:
    for report in reports.values():
        both = report["fsdp_tp"]
        assert both["fused"] == both["logits"] == STEPS * PARAMS
        fsdp_error, tp_weight_error, tp_head_error = both["errors"]
        assert FSDP_FIX.match(fsdp_error), fsdp_error
        assert "weight.to_local() with process_group=<the TP group>" in tp_weight_error
        assert re.match(
            r"^weight: a DTensor .* and no process_group: tensor parallel: pass "
            r"process_group=<the TP group>",
            tp_head_error,
        ), tp_head_error
