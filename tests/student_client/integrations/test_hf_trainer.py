"""``TopKDistillationTrainer`` against the session's vLLM teacher: 20 optimizer steps give
the same losses (within 1e-5) as the hand-written loop of the README on the same seed and
data, with and without gradient accumulation; the loss statistics reach the Trainer's log
history; a ``ReplayClient`` of the loop's recording trains the same way without a
teacher; a recorded payload dataset trains with no client."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ServerProcess

from devtools.tiny_model import tiny_qwen2_config
from student_client.clients.blocking import TeacherClient
from student_client.data.batch import ScoreBatch
from student_client.integrations.hf_trainer import (
    DistillationConfig,
    TopKDistillationTrainer,
    payload_dataset_collator,
)
from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
from student_client.offline.dataset import PayloadDataset
from student_client.offline.replay_client import ReplayClient
from topk_protocol.requests import RequestOptions

pytestmark = pytest.mark.vllm

STEPS, BATCH, K, LR = 20, 4, 8, 3e-3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def student() -> Any:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config(hidden_size=32, num_layers=1, head_dim=16, initializer_range=0.02)
    return Qwen2ForCausalLM(config)


def _examples(n: int) -> list[dict[str, list[int]]]:
    """Ragged byte sequences (lengths 6..20): padded batches once collated."""
    rng = np.random.default_rng(0)
    return [
        {"input_ids": rng.integers(0, 256, size=int(rng.integers(6, 21))).tolist()}
        for _ in range(n)
    ]


def _trainer_args(tmp: Path, accumulation: int, steps: int = STEPS) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )


def _manual_losses(
    model: Any, batches: list[dict[str, torch.Tensor]], client: Any, accumulation: int
) -> list[float]:
    """The README's loop, with gradient accumulation: the per-step mean KD loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    to_student, to_teacher = itertools.tee(batches)
    items = (ScoreBatch(b["input_ids"], attention_mask=b["attention_mask"]) for b in to_teacher)
    payloads = client.stream(items, K, depth=4, include_sampled=False)
    losses: list[float] = []
    step_losses: list[float] = []
    for x, payload in zip(to_student, payloads, strict=True):
        logits = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
        loss, _ = topk_kl_loss(
            logits,
            TeacherTargets(payload.ids, payload.logprobs, mask=payload.mask),
            LossOptions(mode="tail"),
        )
        (loss / accumulation).backward()
        step_losses.append(loss.item())
        if len(step_losses) == accumulation:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(sum(step_losses) / accumulation)
            step_losses = []
    return losses


def _train(
    student: Any,
    tokenizer: Any,
    tmp: Path,
    accumulation: int,
    evaluate: bool = False,
    **kwargs: Any,
) -> TopKDistillationTrainer:
    trainer = TopKDistillationTrainer(
        model=copy.deepcopy(student),
        args=_trainer_args(tmp, accumulation),
        train_dataset=_examples(STEPS * BATCH * accumulation),
        data_collator=lambda feats: tokenizer.pad(feats, return_tensors="pt"),
        distill=DistillationConfig(RequestOptions(K, include_sampled=False), prefetch_depth=4),
        **kwargs,
    )
    trainer.train()
    if evaluate:
        # Evaluation batches are not prefetched: their payloads are fetched on the spot.
        metrics = trainer.evaluate(eval_dataset=_examples(2 * BATCH))
        assert np.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    trainer.close()
    return trainer


def _logged(trainer: TopKDistillationTrainer, name: str) -> list[float]:
    return [row[name] for row in trainer.state.log_history if name in row]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_matches_the_manual_loop(
    vllm_teacher: ServerProcess,
    student: Any,
    tokenizer: Any,
    tmp_path: Path,
    accumulation: int,
) -> None:
    tokenizer.padding_side = "right"
    examples = _examples(STEPS * BATCH * accumulation)
    batches = [
        tokenizer.pad(examples[i : i + BATCH], return_tensors="pt")
        for i in range(0, len(examples), BATCH)
    ]
    assert not all(b["attention_mask"].all() for b in batches), "batches must be padded"
    torch.manual_seed(0)
    rec = tmp_path / "loop-recording"
    with TeacherClient(vllm_teacher.target, record_to=rec) as client:
        manual = _manual_losses(copy.deepcopy(student), batches, client, accumulation)
    assert len(manual) == STEPS

    trainer = _train(
        student,
        tokenizer,
        tmp_path / "out",
        accumulation,
        evaluate=accumulation == 1,
        teacher=vllm_teacher.target,
    )
    logged = _logged(trainer, "kd_loss")
    assert len(logged) == STEPS
    np.testing.assert_allclose(logged, manual, rtol=1e-5, atol=1e-5)
    assert manual[-1] < manual[0]  # it learns
    row = next(r for r in trainer.state.log_history if "kd_loss" in r)
    for name in ("kd_teacher_mass", "kd_student_mass", "kd_overlap", "kd_positions", "loss"):
        assert name in row, (name, row)
    assert 0.0 < row["kd_teacher_mass"] <= 1.0
    if accumulation == 1:
        # The same job from the loop's recording: no teacher, the same losses.
        with ReplayClient(rec) as replay:
            again = _train(student, tokenizer, tmp_path / "replay", 1, teacher=replay)
        np.testing.assert_allclose(_logged(again, "kd_loss"), manual, rtol=1e-5, atol=1e-5)


def test_payload_dataset_trains_without_a_client(
    vllm_teacher: ServerProcess, student: Any, tokenizer: Any, tmp_path: Path
) -> None:
    """A recorded ``PayloadDataset`` through ``payload_dataset_collator`` trains with no
    client (``teacher=None``) and gives the live teacher's losses on the same batches."""
    tokenizer.padding_side = "right"
    examples = _examples(3 * BATCH)
    scored = tmp_path / "scored"
    with TeacherClient(vllm_teacher.target, record_to=scored) as client:
        for i in range(0, len(examples), BATCH):
            batch = tokenizer.pad(examples[i : i + BATCH], return_tensors="pt")
            client.score(batch, K, include_sampled=False)
        live = _train(student, tokenizer, tmp_path / "live", 1, teacher=client)
    trainer = TopKDistillationTrainer(
        model=copy.deepcopy(student),
        args=_trainer_args(tmp_path / "ds", 1, steps=3),
        train_dataset=PayloadDataset(scored, include_sampled=False),
        data_collator=payload_dataset_collator(pad_id=tokenizer.pad_token_id),
        distill=DistillationConfig(RequestOptions(K, include_sampled=False)),
    )
    trainer.train()
    ds_losses = _logged(trainer, "kd_loss")
    assert len(ds_losses) == 3
    np.testing.assert_allclose(ds_losses, _logged(live, "kd_loss")[:3], rtol=1e-5, atol=1e-5)


def test_fused_trainer_matches_the_logits_path(
    vllm_teacher: ServerProcess, student: Any, tokenizer: Any, tmp_path: Path
) -> None:
    """``DistillationConfig(fused=True)`` (hidden states + lm_head, no logits) trains the
    same steps as the logits path."""
    tokenizer.padding_side = "right"
    losses = []
    with TeacherClient(vllm_teacher.target) as client:
        for fused in (False, True):
            trainer = TopKDistillationTrainer(
                model=copy.deepcopy(student),
                args=_trainer_args(tmp_path / f"fused-{fused}", 1, steps=4),
                train_dataset=_examples(4 * BATCH),
                data_collator=lambda feats: tokenizer.pad(feats, return_tensors="pt"),
                teacher=client,
                distill=DistillationConfig(RequestOptions(K), fused=fused),
            )
            trainer.train()
            losses.append(_logged(trainer, "kd_loss"))
    assert len(losses[1]) == 4
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, atol=1e-5)


class _Watching:
    """A ``TeacherSource`` around a client that keeps what the Trainer asked with and what
    came back (the request options, whether candidates were sent, the payloads' kinds)."""

    def __init__(self, client: TeacherClient) -> None:
        self.client = client
        self.asked: list[Any] = []
        self.candidates_sent: list[bool] = []
        self.payloads: list[Any] = []

    @property
    def names(self) -> list[str]:
        return []

    def info(self) -> Any:
        return self.client.info()

    def score(self, sequences: Any, top_k: Any = None, **kw: Any) -> Any:
        self.asked.append(top_k)
        self.candidates_sent.append(kw.get("candidate_ids") is not None)
        payload = self.client.score(sequences, top_k, **kw)
        self.payloads.append(payload)
        return payload

    def stream(self, batches: Any, top_k: Any = None, **kw: Any) -> Any:
        self.asked.append(top_k)

        def seen(items: Any) -> Any:
            for item in items:
                self.candidates_sent.append(item.candidate_ids is not None)
                yield item

        for payload in self.client.stream(seen(batches), top_k, **kw):
            self.payloads.append(payload)
            yield payload

    def close(self) -> None:
        self.client.close()


@pytest.mark.parametrize(
    "distill",
    [
        DistillationConfig(RequestOptions(K, encoding="packed", include_sampled=False)),
        DistillationConfig(RequestOptions(K, samples=K, seed=3, include_sampled=False)),
        DistillationConfig(
            RequestOptions(K, include_sampled=False),
            loss=LossOptions(support="union", divergence="reverse"),
            candidates=4,
        ),
    ],
    ids=["packed", "sampled", "union"],
)
def test_trainer_asks_with_the_configs_request_options(
    vllm_teacher: ServerProcess,
    student: Any,
    tokenizer: Any,
    tmp_path: Path,
    distill: DistillationConfig,
) -> None:
    """Packed, sampled and candidate requests reach the Trainer: every teacher call is made
    with the config's ``RequestOptions`` (the prefetcher's), the payloads are of that kind,
    the student's own top-C candidates reach the teacher for ``support="union"``, and the
    Trainer trains (finite losses logged every step)."""
    tokenizer.padding_side = "right"
    steps = 4
    with TeacherClient(vllm_teacher.target) as client:
        watching = _Watching(client)
        trainer = TopKDistillationTrainer(
            model=copy.deepcopy(student),
            args=_trainer_args(tmp_path, 1, steps=steps),
            train_dataset=_examples(steps * BATCH),
            data_collator=lambda feats: tokenizer.pad(feats, return_tensors="pt"),
            distill=distill,
            teacher=watching,
        )
        trainer.train()
        trainer.close()
    assert watching.asked and all(asked == distill.request for asked in watching.asked)
    assert len(watching.payloads) >= steps
    losses = _logged(trainer, "kd_loss")
    assert len(losses) == steps and all(np.isfinite(losses)), losses
    payload = watching.payloads[0]
    if distill.request.sampled:
        assert payload.sample_counts is not None
        assert int(payload.sample_counts[payload.mask].sum(-1).unique()[0]) == K
    if distill.candidates:
        assert all(watching.candidates_sent)
        assert payload.candidate_ids is not None and payload.candidate_ids.shape[-1] == 4
        assert bool(payload.candidate_logprobs[payload.candidate_ids >= 0].isfinite().all())
    else:
        assert not any(watching.candidates_sent)
