"""``TRLTeacherClient`` (gRPC) returns what TRL's own ``VLLMClient`` (HTTP) returns from
the same teacher, and a TRL trainer's teacher-scoring step runs against the teacher with
either client: ``ServerDistillationTrainer.compute_loss`` (student forward, the teacher's
top-k log-probs for the completion, TRL's sparse forward KL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.json_render_reference import as_float32
from student_client.integrations.trl_client import TRLTeacherClient
from tests.conftest import ServerProcess
from topk_protocol.errors import InvalidRequestError, TeacherMismatchError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def clients(vllm_teacher: ServerProcess) -> Any:
    from trl.generation.vllm_client import VLLMClient

    with TRLTeacherClient(vllm_teacher.target) as ours:
        yield VLLMClient(base_url=vllm_teacher.http, connection_timeout=60), ours


def test_drop_in_returns_what_trls_client_returns(clients: Any) -> None:
    trl, ours = clients
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 512, n).tolist() for n in (1, 3, 40, 129, 7)]
    lengths = [0, 0, 12, 100, 7]
    for k in (1, 16):
        # The same float32 values: TRL's client reads the JSON's shortest float32
        # decimals, ours the arrays, widened.
        want = as_float32(trl.get_sequence_logprobs(seqs, lengths, top_logprobs=k))
        assert as_float32(ours.get_sequence_logprobs(seqs, lengths, top_logprobs=k)) == want
        # Chunks of 2 sequences, 3 requests in flight on one stream: the same answer.
        chunked = ours.get_sequence_logprobs(
            seqs, lengths, top_logprobs=k, chunk_size=2, max_concurrent_requests=3
        )
        assert as_float32(chunked) == want
    assert [len(r) for r in want["logprobs"]] == [1, 3, 28, 29, 0]


def test_drop_in_refuses_by_name(clients: Any) -> None:
    _, ours = clients
    with pytest.raises(TeacherMismatchError, match=r"temperature: the request asks for 2, .* 1\b"):
        ours.get_sequence_logprobs([[1, 2, 3]], [0], top_logprobs=4, temperature=2.0)
    with pytest.raises(InvalidRequestError, match=r"top_k: 300 is outside \[1, 256\]"):
        ours.get_sequence_logprobs([[1, 2, 3]], [0], top_logprobs=300)
    with pytest.raises(InvalidRequestError, match=r"prompt_lengths\[0\]: 4 is outside \[0, 3\]"):
        ours.get_sequence_logprobs([[1, 2, 3]], [4], top_logprobs=4)
    with pytest.raises(InvalidRequestError, match=r"token_ids\[1\]: 600 is outside the vocab"):
        ours.get_sequence_logprobs([[1, 600, 3]], [0], top_logprobs=4)
    assert len(ours.get_sequence_logprobs([[1, 2, 3]], [1], top_logprobs=4)["logprobs"][0]) == 2


def _trainer(model_dir: Path, teacher_url: str, out: Path) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )

    args = ServerDistillationConfig(
        output_dir=str(out),
        teacher_model_server_url=teacher_url,
        loss_top_k=8,
        beta=0.0,  # TRL's sparse forward KL over the teacher's top 8
        max_completion_length=8,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
    )
    return ServerDistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"], "completion": ["ef", "gh"]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def test_server_distillation_trainer_scores_with_our_teacher(
    vllm_teacher: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """TRL's trainer, unchanged, on our HTTP port; then with ``trainer.teacher_client``
    replaced by the gRPC drop-in: the same teacher tensors, the same loss. A student with
    the teacher's weights has a loss of ~0; another student does not."""
    from devtools.tiny_model import write_tiny_model

    batch = {  # right-padded completions, as TRL's generation step produces them
        "prompt_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]),
        "prompt_mask": torch.ones(2, 3, dtype=torch.long),
        "completion_ids": torch.tensor([[11, 12, 13, 14], [15, 16, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }
    losses = {}
    for name, model_dir in [
        ("teacher weights", tiny_model_dir),
        ("other student", write_tiny_model(tmp_path / "student", seed=1)),
    ]:
        trainer = _trainer(model_dir, vllm_teacher.http, tmp_path / "out")
        assert type(trainer.teacher_client).__module__ == "trl.generation.vllm_client"
        http_loss = trainer.compute_loss(trainer.model, dict(batch))
        with TRLTeacherClient(vllm_teacher.target) as drop_in:
            trainer.teacher_client = drop_in
            grpc_loss = trainer.compute_loss(trainer.model, dict(batch))
        assert torch.isfinite(http_loss)
        assert grpc_loss.item() == pytest.approx(http_loss.item(), rel=1e-7, abs=1e-7)
        losses[name] = http_loss.item()
    assert abs(losses["teacher weights"]) < 1e-4
    assert losses["other student"] > 0.1
