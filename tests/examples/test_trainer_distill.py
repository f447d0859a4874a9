"""``TopKDistillationTrainer`` under ``accelerate launch`` with 2 CPU processes (gloo)
against the session's vLLM teacher: each rank its own client, prefetch and recording; the
parameters equal those of one process trained on the same global batches (within 1e-5),
the logged ``kd_*`` are the means over the ranks, and the ranks' recordings hold every row
of the data exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess
from test_ddp_training_loop import launch_env

from examples import trainer_distill
from student_client.integrations.distributed import rank_recordings, recorded_dataset

pytestmark = pytest.mark.vllm

STEPS, BATCH, SEQ, K, WORLD = 4, 2, 16, 8, 2


def test_accelerate_trainer_matches_one_process(
    vllm_teacher: ServerProcess, tmp_path: Path
) -> None:
    out, record = tmp_path / "out", tmp_path / "record"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", str(WORLD), "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", "0", "-m", "examples.trainer_distill",
        "--teacher", vllm_teacher.target, "--out", str(out), "--record", str(record),
        "--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
        "--top-k", str(K),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    reference = trainer_distill.train(
        vllm_teacher.target, tmp_path / "one", steps=STEPS, batch_size=BATCH * WORLD,
        seq_len=SEQ, top_k=K,
    )  # fmt: skip
    want = reference.model.state_dict()
    states = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    for name, value in want.items():
        assert torch.equal(states[0][name], states[1][name]), name
        torch.testing.assert_close(states[0][name], value, rtol=1e-5, atol=1e-5, msg=name)

    histories = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    steps = [[h for h in history if "kd_loss" in h] for history in histories]
    one = [h for h in reference.state.log_history if "kd_loss" in h]
    assert len(steps[0]) == len(one) == STEPS
    for rank0, rank1, single in zip(*steps, one, strict=True):
        # Means over the ranks (the same on both), equal to one process's on the global
        # batch (equal-length rows: the mean of the halves' means is the global mean).
        assert rank0["kd_loss"] == rank1["kd_loss"]
        assert rank0["kd_teacher_mass"] == pytest.approx(single["kd_teacher_mass"], rel=1e-6)
        assert rank0["kd_loss"] == pytest.approx(single["kd_loss"], rel=1e-4)

    recorded = recorded_dataset(record)
    rows = sorted(tuple(recorded[i][0].tolist()) for i in range(len(recorded)))
    vocab = reference.model.config.vocab_size
    data = trainer_distill.window_examples(STEPS * BATCH * WORLD, SEQ, vocab)
    assert rows == sorted(tuple(e["input_ids"]) for e in data)
    assert len(rank_recordings(record)) == WORLD
