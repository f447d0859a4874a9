"""``examples/trl_distill.py``: TRL's ``ServerDistillationTrainer.train()`` (on-policy
generation with the student, the teacher's log-probs, TRL's loss, an optimizer step) on
the session's teacher, once through TRL's own client on the HTTP port and once through
the gRPC drop-in: the same logged losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import ServerProcess

from devtools.tiny_model import write_tiny_model
from examples import trl_distill

pytestmark = pytest.mark.vllm


def test_trl_trainer_trains_on_our_teacher_both_ways(
    vllm_teacher: ServerProcess, tmp_path: Path
) -> None:
    student = write_tiny_model(tmp_path / "student", seed=1)
    common = ["--teacher-http", vllm_teacher.http, "--student", str(student), "--steps", "1"]
    http = trl_distill.main([*common, "--out", str(tmp_path / "http")])
    grpc = trl_distill.main(
        [*common, "--teacher", vllm_teacher.target, "--out", str(tmp_path / "g")]
    )
    assert len(http) == len(grpc) == 1
    assert math.isfinite(http[0]["loss"]) and http[0]["loss"] > 0.1
    assert grpc[0]["loss"] == pytest.approx(http[0]["loss"], rel=1e-6, abs=1e-6)
