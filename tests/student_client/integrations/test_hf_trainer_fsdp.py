"""``TopKDistillationTrainer`` with ``DistillationConfig(fused=True)`` under FSDP2 on 2 gloo
CPU processes equals one process.

Each rank loads the student sharded by transformers' own FSDP2
(``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``, which the Trainer
trains as it is: no DDP) and replays its own batches' payloads from a recording made here
(``ReplayClient``; no vLLM). Two layouts, one spawn:

- ``"head"``: transformers' plan for Qwen2: the embeddings and every decoder layer a unit,
  the final norm and the lm_head one unit, the root a unit;
- ``"root"``: the layout accelerate's FSDP2 plugin makes (its CPU path refuses FSDP): the
  decoder layers units, the root unit holding the embeddings, the final norm and the
  lm_head.

Three optimizer steps (SGD, each clipped to a gradient norm of ``CLIP``): the logged
``loss`` / ``kd_loss`` and every updated parameter (gathered with ``full_tensor()``) equal
those of one process training on the same global batches, within 1e-5. Rows have equal
lengths, so every rank counts as many positions and the mean of the ranks' mean losses is
the global mean.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2ForCausalLM

from devtools.tiny_model import tiny_qwen2_config
from student_client.integrations.hf_trainer import DistillationConfig, TopKDistillationTrainer
from student_client.offline.replay_client import ReplayClient
from topk_protocol import SequenceArrays, pb
from topk_protocol.recording import RecordingWriter
from topk_protocol.requests import RequestOptions

VOCAB, K, SEQ, BATCH, WORLD, STEPS, LR = 320, 8, 12, 2, 2, 3, 1.0
TOLERANCE = 1e-5
CLIP = 0.05  # below the gradient norms: every step clips (the norm over the shards)
LAYOUTS = ("head", "root")


class RootHeadQwen2(Qwen2ForCausalLM):
    """Layout ``"root"``: only the decoder layers are FSDP units of their own."""

    def init_parallel_plans(self) -> None:
        super().init_parallel_plans()
        self._fsdp_plan = {"model.layers.*": "free_full_weight"}


def _examples() -> list[dict[str, list[int]]]:
    """Every step's global batch, in order: ``STEPS * WORLD * BATCH`` rows of ``SEQ``
    tokens. Accelerate hands rank ``r`` the ``r``-th ``BATCH`` rows of each."""
    rng = np.random.default_rng(0)
    return [
        {"input_ids": rng.integers(0, VOCAB, SEQ).tolist()} for _ in range(STEPS * WORLD * BATCH)
    ]


def _write_inputs(root: Path) -> None:
    """The student's initial weights and a recording of a random teacher's top-K rows
    (sorted, float32) at every position of every example."""
    torch.manual_seed(0)
    config = tiny_qwen2_config(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, head_dim=16, initializer_range=0.02
    )
    config._attn_implementation = "eager"
    Qwen2ForCausalLM(config).save_pretrained(root / "student")
    info = pb.TeacherInfo(
        model_name="random-teacher", vocab_size=VOCAB, max_top_k=K,
        tokenizer_fingerprint="cd" * 32, schema_version=1, backend="test",
    )  # fmt: skip
    with RecordingWriter(root / "recording", info, top_k=K, dtype="float32") as writer:
        for example in _examples():
            teacher = torch.log_softmax(torch.randn(SEQ, VOCAB) * 3, -1)
            logprobs, ids = teacher.topk(K, dim=-1)
            arrays = SequenceArrays(ids.numpy(), logprobs.numpy())
            writer.add(example["input_ids"], arrays, dtype="float32")


def _train(model: Any, root: Path, out: str, batch_size: int) -> TopKDistillationTrainer:
    from transformers import TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir=str(root / out), per_device_train_batch_size=batch_size, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, optim="sgd",
        max_grad_norm=CLIP, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True,
    )  # fmt: skip
    with ReplayClient(root / "recording") as replay:
        trainer = TopKDistillationTrainer(
            model=model,
            args=args,
            train_dataset=_examples(),
            data_collator=default_data_collator,
            teacher=replay,
            distill=DistillationConfig(
                RequestOptions(K, dtype="float32", include_sampled=False), fused=True
            ),
        )
        trainer.train()
        trainer.close()
    return trainer


def _logged(trainer: TopKDistillationTrainer) -> dict[str, list[float]]:
    rows = [row for row in trainer.state.log_history if "kd_loss" in row]
    return {name: [row[name] for row in rows] for name in ("loss", "kd_loss")}


def _worker(rank: int, root_dir: str) -> None:
    """One rank: each layout's sharded student trained by the Trainer; rank 0 writes the
    gathered parameters and the logged losses."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    root = Path(root_dir)
    # The launcher's environment, as torchrun sets it (accelerate reads it); the group
    # itself starts from a file (no port to race for).
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": WORLD, "LOCAL_WORLD_SIZE": WORLD}
    os.environ.update({k: str(v) for k, v in ranks.items()})
    init = f"file://{root / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    for layout in LAYOUTS:
        model_class = Qwen2ForCausalLM if layout == "head" else RootHeadQwen2
        model = model_class.from_pretrained(
            root / "student", distributed_config=DistributedConfig(fsdp_size=WORLD)
        )
        assert isinstance(model.lm_head.weight, DTensor)
        assert isinstance(model.lm_head, FSDPModule) == (layout == "head"), layout
        trainer = _train(model, root, f"{layout}-{rank}", BATCH)
        params = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in trainer.model.named_parameters()
        }
        if rank == 0:
            torch.save(params, root / f"{layout}.pt")
            (root / f"{layout}.json").write_text(json.dumps(_logged(trainer)))
    dist.destroy_process_group()


def test_fused_trainer_under_fsdp2_matches_one_process(tmp_path: Path) -> None:
    _write_inputs(tmp_path)
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)

    model = Qwen2ForCausalLM.from_pretrained(tmp_path / "student")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = _train(model, tmp_path, "one", WORLD * BATCH)
    want = _logged(reference)
    assert len(want["kd_loss"]) == STEPS
    trained = {name: p.detach() for name, p in reference.model.named_parameters()}
    # Both ends of the fused loss's gradient (lm_head, embeddings) moved far beyond the
    # tolerance: the comparison says something.
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        moved = float((trained[name] - initial[name]).abs().max())
        assert moved > 100 * TOLERANCE, (name, moved)
    for layout in LAYOUTS:
        logged = json.loads((tmp_path / f"{layout}.json").read_text())
        params = torch.load(tmp_path / f"{layout}.pt")
        assert params.keys() == trained.keys()
        losses = {k: float(np.abs(np.subtract(logged[k], want[k])).max()) for k in want}
        weights = {k: float((v - trained[k]).abs().max()) for k, v in params.items()}
        worst = max(weights, key=weights.__getitem__)
        assert max(losses.values()) <= TOLERANCE, (layout, losses)
        assert weights[worst] <= TOLERANCE, (layout, worst, weights[worst])
