"""``TopKDistillationTrainer`` keeps the losses' no-sync promise: with
``LossOptions(validate=False)`` one training step (student forward, loss, backward) never
waits for the device, on the logits path and the fused path; the ``kd_*`` statistics stay
device tensors until ``Trainer.log``, which logs the same means as reading every
micro-batch's stats on the host (the previous behaviour) within 1e-6. No teacher: the
batches carry the payload columns (as from a payload dataset).

The student uses eager attention and gets an ``attention_mask``: transformers' own sdpa
mask preparation reads values on the host (``_ignore_causal_mask_sdpa``, and
``find_packed_sequence_indices`` without a mask), a sync of the model's, not of this
package's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from host_sync import NoHostSync

from devtools.tiny_model import tiny_qwen2_config
from student_client.integrations.hf_trainer import (
    TEACHER_KEY,
    DistillationConfig,
    TopKDistillationTrainer,
)
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
from topk_protocol.requests import RequestOptions

K, VOCAB = 6, 300


def _student() -> Any:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, head_dim=16, initializer_range=0.02
    )
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config)


def _batch(seed: int, mode: str = "tail") -> dict[str, Any]:
    """A ``[2, 9]`` batch with its payload; the second row's last 3 are padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    teacher = torch.log_softmax(torch.randn(2, 9, VOCAB, generator=generator) * 3, -1)
    logprobs, ids = teacher.topk(K, dim=-1)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    payload = SimpleNamespace(ids=ids, logprobs=logprobs.half().float(), mask=mask)
    payload.sampled_logprobs = None
    if mode == "tail_actual":
        following = torch.roll(input_ids, -1, dims=-1)
        sampled = teacher.gather(-1, following.unsqueeze(-1)).squeeze(-1)
        sampled[:, -1] = float("nan")
        payload.sampled_logprobs = sampled
    return {"input_ids": input_ids, "attention_mask": mask.long(), TEACHER_KEY: payload}


def _trainer(tmp_path: Path, fused: bool, loss: LossOptions) -> TopKDistillationTrainer:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TopKDistillationTrainer(
        model=_student(),
        args=args,
        train_dataset=[_batch(0)],
        distill=DistillationConfig(RequestOptions(K), fused=fused, loss=loss),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop
    return trainer


OPTIONS = [
    LossOptions(validate=False),
    LossOptions(validate=False, divergence="reverse", mode="tail_actual", overlap=True),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["forward-tail", "reverse-actual"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_training_step_does_not_sync(tmp_path: Path, fused: bool, options: LossOptions) -> None:
    trainer = _trainer(tmp_path, fused, options)
    model = trainer.model
    batch = _batch(1, options.mode)
    guard = NoHostSync()
    with guard:
        loss = trainer.training_step(model, batch)
    assert guard.ops > 0
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
    kd = trainer._kd_metrics
    assert set(kd) >= {"kd_loss", "kd_teacher_mass", "kd_positions"}
    assert all(isinstance(v, torch.Tensor) for values in kd.values() for v in values)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_logged_statistics_equal_the_host_means(tmp_path: Path, fused: bool) -> None:
    """Three micro-batches, then one log: each ``kd_*`` is the mean of the three batches'
    host-read stats (what the Trainer logged before it kept tensors), within 1e-6."""
    options = LossOptions(validate=False, overlap=True)
    trainer = _trainer(tmp_path, fused, options)
    model = trainer.model
    batches = [_batch(seed) for seed in (2, 3, 4)]
    expected: dict[str, list[float]] = {}
    for batch in batches:
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        teacher = TeacherTargets.from_payload(batch[TEACHER_KEY])
        _, stats = topk_kl_loss(logits, teacher, options)
        for name, value in stats.as_dict().items():
            expected.setdefault(f"kd_{name}", []).append(value)
        trainer.compute_loss(model, batch)  # model.training: accumulates; no update
    logs: dict[str, float] = {"loss": 0.0}
    trainer.log(logs)
    for name, values in expected.items():
        assert logs[name] == pytest.approx(sum(values) / len(values), abs=1e-6, rel=1e-6), name
    assert logs["kd_positions"] == pytest.approx(15.0)
    assert not trainer._kd_metrics  # cleared once logged
