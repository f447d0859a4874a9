"""Data parallel against the session's vLLM teacher: ``torchrun --nproc-per-node 2`` of
``examples.ddp_training_loop`` (DDP on gloo, a client per rank) ends with the parameters of
one process trained on the same global batches (within 1e-5), logs statistics averaged
over the ranks, and records per rank: together the recordings hold every row of the data
exactly once, and each rank's recording replays that rank's batches as the teacher
answers them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, ServerProcess

from examples import ddp_training_loop as ddp
from student_client.clients.blocking import TeacherClient
from student_client.integrations.distributed import rank_recordings, recorded_dataset
from student_client.offline.replay_client import ReplayClient

pytestmark = pytest.mark.vllm

STEPS, BATCH, SEQ, K, WORLD = 6, 2, 16, 8, 2
ARGS = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
        "--top-k", str(K), "--depth", "2"]  # fmt: skip


def launch_env() -> dict[str, str]:
    """The environment of launched ranks: this checkout first on the path, one thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_torchrun_ddp_matches_one_process(vllm_teacher: ServerProcess, tmp_path: Path) -> None:
    out, record = tmp_path / "out", tmp_path / "record"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(WORLD), "-m", "examples.ddp_training_loop",
        "--teacher", vllm_teacher.target, "--record", str(record), "--out", str(out), *ARGS,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    states = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    with TeacherClient(vllm_teacher.target) as client:
        vocab = client.info().vocab_size
        reference = ddp.train(
            client, steps=STEPS, batch_size=BATCH * WORLD, seq_len=SEQ, top_k=K, depth=2,
            quiet=True,
        )  # fmt: skip
        # Each rank's recording replays its own batches as the teacher answers them.
        data = ddp.window_dataset(STEPS * BATCH * WORLD, SEQ, vocab)
        for rank, path in enumerate(rank_recordings(record)):
            with ReplayClient(path) as replay:
                batches = list(ddp.rank_batches(data, BATCH, rank, WORLD))
                for x, got in zip(batches, replay.stream(batches, K), strict=True):
                    want = client.score(x, K)
                    assert torch.equal(got.ids, want.ids) and torch.equal(
                        got.logprobs, want.logprobs
                    )

    for name, want in reference["state"].items():
        assert torch.equal(states[0][name], states[1][name]), name  # replicas in sync
        torch.testing.assert_close(states[0][name], want, rtol=1e-5, atol=1e-5, msg=name)
    # Logged statistics: the mean over the ranks, the same on both.
    assert summaries[0]["logged"] == summaries[1]["logged"]
    for step, logged in enumerate(summaries[0]["logged"]):
        mean = sum(s["losses"][step] for s in summaries) / WORLD
        assert logged["loss"] == pytest.approx(mean, rel=1e-12)
        # One process's loss on the global batch: the mean of the ranks' equal-size halves.
        assert logged["loss"] == pytest.approx(reference["losses"][step], rel=1e-4)

    # Every row of the data recorded exactly once over the ranks (none twice, none skipped).
    recorded = recorded_dataset(record)
    rows = sorted(tuple(recorded[i][0].tolist()) for i in range(len(recorded)))
    assert rows == sorted(tuple(data[i][0].tolist()) for i in range(len(data)))
    assert len(rank_recordings(record)) == WORLD
