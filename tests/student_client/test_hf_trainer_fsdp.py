"""``TopKDistillationTrainer`` with ``DistillationConfig(fused=True)`` under FSDP2, on 2 gloo
CPU processes: the student is loaded sharded (transformers' own FSDP2,
``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``: every decoder layer,
the embeddings, the final norm with the lm_head, and the root each a ``fully_shard`` unit),
each rank replays its own batches' payloads from a recording made here (``ReplayClient``),
and the Trainer's logged losses and the updated parameters equal those of one process
training on the same global batches, within 1e-5.

No vLLM: the recording is written from random teacher rows. Equal-length rows, so every
rank counts as many positions and the mean of the ranks' mean losses is the global mean.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from devtools.launch import free_port
from devtools.tiny_model import tiny_qwen2_config
from student_client.hf_trainer import DistillationConfig, TopKDistillationTrainer
from student_client.replay import ReplayClient
from topk_protocol import pb
from topk_protocol.recording import RecordingWriter

VOCAB, K, SEQ, BATCH, WORLD, STEPS, LR = 320, 8, 12, 2, 2, 3, 1e-2
TOLERANCE = 1e-5


def _examples() -> list[dict[str, list[int]]]:
    """The global batches of every step, in order: ``STEPS * WORLD * BATCH`` rows of
    ``SEQ`` tokens (equal lengths: no padding)."""
    rng = np.random.default_rng(0)
    return [
        {"input_ids": rng.integers(0, VOCAB, SEQ).tolist()} for _ in range(STEPS * WORLD * BATCH)
    ]


def _record(path: Path) -> None:
    """A teacher answer (``[SEQ, K]`` distinct ids, sorted log-probs) for every example."""
    info = pb.TeacherInfo(
        model_name="random-teacher", vocab_size=VOCAB, max_top_k=K,
        tokenizer_fingerprint="cd" * 32, schema_version=1, backend="test",
    )  # fmt: skip
    rng = np.random.default_rng(1)
    with RecordingWriter(path, info, top_k=K, dtype="float32") as writer:
        for example in _examples():
            ids = np.argsort(rng.random((SEQ, VOCAB)), axis=1)[:, :K]
            logits = torch.from_numpy(rng.normal(0, 3, (SEQ, VOCAB)))
            full = torch.log_softmax(logits, -1).numpy()
            lps = -np.sort(-np.take_along_axis(full, ids, 1), axis=1)
            order = np.argsort(-np.take_along_axis(full, ids, 1), axis=1)
            ids = np.take_along_axis(ids, order, 1)
            writer.add(example["input_ids"], ids, lps, None, start=0, dtype="float32")


def _write_student(path: Path) -> None:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, head_dim=16, initializer_range=0.02
    )
    config._attn_implementation = "eager"
    Qwen2ForCausalLM(config).save_pretrained(path)


def _train(model: Any, recording: Path, out: Path, batch_size: int) -> TopKDistillationTrainer:
    from transformers import TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch_size, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, optim="adamw_torch",
        max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True,
    )  # fmt: skip
    with ReplayClient(recording) as replay:
        trainer = TopKDistillationTrainer(
            model=model,
            args=args,
            train_dataset=_examples(),
            data_collator=default_data_collator,
            teacher=replay,
            distill=DistillationConfig(top_k=K, fused=True, dtype="float32"),
        )
        trainer.train()
        trainer.close()
    return trainer


def _logged(trainer: TopKDistillationTrainer) -> dict[str, list[float]]:
    rows = [row for row in trainer.state.log_history if "kd_loss" in row]
    return {name: [row[name] for row in rows] for name in ("loss", "kd_loss")}


def _worker(rank: int, port: int, root: str) -> None:
    """One FSDP2 rank: the sharded student trained by the Trainer; rank 0 writes the
    gathered parameters and the logged losses."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2ForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD)}  # fmt: skip
    os.environ.update(env)
    base = Path(root)
    model = Qwen2ForCausalLM.from_pretrained(
        base / "student", distributed_config=DistributedConfig(fsdp_size=WORLD)
    )
    assert isinstance(model.lm_head.weight, DTensor), "the lm_head must be sharded"
    trainer = _train(model, base / "recording", base / f"rank{rank}", BATCH)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
    }
    if rank == 0:
        torch.save(params, base / "fsdp.pt")
        (base / "fsdp.json").write_text(json.dumps(_logged(trainer)))
    torch.distributed.destroy_process_group()


def test_fused_trainer_under_fsdp2_matches_one_process(tmp_path: Path) -> None:
    from transformers import Qwen2ForCausalLM

    _write_student(tmp_path / "student")
    _record(tmp_path / "recording")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)

    reference = _train(
        Qwen2ForCausalLM.from_pretrained(tmp_path / "student"),
        tmp_path / "recording",
        tmp_path / "one",
        WORLD * BATCH,
    )
    want = _logged(reference)
    got = json.loads((tmp_path / "fsdp.json").read_text())
    assert len(want["kd_loss"]) == STEPS
    diffs = {}
    for name in want:
        diffs[name] = float(np.abs(np.subtract(got[name], want[name])).max())
    params = torch.load(tmp_path / "fsdp.pt")
    ref_params = dict(reference.model.named_parameters())
    assert params.keys() == ref_params.keys()
    moved = 0.0
    for name, value in params.items():
        diffs[name] = float((value - ref_params[name].detach()).abs().max())
        moved = max(moved, float((ref_params[name].detach() - value).abs().max()))
    print(diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs
