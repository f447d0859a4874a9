"""``examples/cross_tokenizer.py``, short: a BPE teacher of 512 ids (briefly pretrained)
serves a BPE student tokenizer of 400 ids learned from the same files; a fresh student of
that tokenizer, distilled through ``TeacherClient(..., student_tokenizer=...)``, lowers
its held-out distillation loss and its own cross-entropy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import start_server

from examples import cross_tokenizer
from examples.teacher_pretrain import PretrainConfig, build_default_teacher

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = PretrainConfig(
        tokenizer="bpe", vocab_size=512, train_seconds=0, max_steps=80, batch_size=8,
        seq_len=128, eval_windows=8, warmup_steps=5, corpus_max_bytes=2_000_000,
    )  # fmt: skip
    return build_default_teacher(tmp_path_factory.mktemp("teacher") / "t", config=config)


def test_a_student_of_another_tokenizer_learns(
    teacher_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = tmp_path / "student-tokenizer"
    assert cross_tokenizer.main(["--write-tokenizer", str(tokenizer)]) == 0
    server = start_server(
        ["--backend", "vllm", "--model", str(teacher_dir), "--dtype", "float32",
         "--max-model-len", "1024", "--student-tokenizer", f"code={tokenizer}"],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        code = cross_tokenizer.main(
            ["--teacher", server.target, "--tokenizer-dir", str(tokenizer), "--steps", "40",
             "--out", str(tmp_path / "out"), "--eval-windows", "16"]
        )  # fmt: skip
    finally:
        assert server.stop() == 0
    assert code == 0
    assert "| kd_loss |" in capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "result.json").read_text())["result"]
    before, after = result["before"], result["after"]
    assert after["kd_loss"] < 0.7 * before["kd_loss"], (before, after)
    assert after["student_ce"] < before["student_ce"], (before, after)
    assert len(result["train_loss"]) == 40 and result["heldout_rows"] > 0
