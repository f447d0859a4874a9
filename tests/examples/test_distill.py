"""The main job, short: a briefly pretrained byte-level teacher (as ``make demo`` builds,
with a smaller budget) served by a real vLLM-backed ``teacher-server``; a fresh student
distilled through the client must lower held-out KL(teacher || student) clearly; then the
same run through a recording gives the same numbers, and training on the recording as a
shuffled payload dataset (``--dataset``) lowers the KL too. The on-policy example runs
against the same teacher.

(The session's shared vLLM server runs a *random* model: nothing a small student can
imitate in a few steps. This test needs a teacher that learned something, so it starts
its own engine on one, once.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerProcess, start_server

from examples import distill
from examples.teacher_pretrain import PretrainConfig, build_default_teacher

pytestmark = pytest.mark.vllm

ARGS = [
    "--steps", "24", "--batch-size", "8", "--seq-len", "128", "--top-k", "16",
    "--eval-windows", "8", "--eval-every", "12", "--depth", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = PretrainConfig(
        train_seconds=0, max_steps=80, batch_size=8, seq_len=128, eval_windows=8, warmup_steps=5
    )
    return build_default_teacher(tmp_path_factory.mktemp("teacher") / "t", config=config)


@pytest.fixture(scope="module")
def pretrained_teacher(
    teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("distill-teacher") / "server.log"
    server = start_server(
        ["--backend", "vllm", "--model", str(teacher_dir), "--dtype", "float32",
         "--max-model-len", "1024"],
        log,
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())["result"]


def test_distill_reduces_heldout_kl_and_replays(
    pretrained_teacher: ServerProcess,
    teacher_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rec = tmp_path / "run-recording"
    live = tmp_path / "live"
    code = distill.main(
        ["--teacher", pretrained_teacher.target, "--teacher-dir", str(teacher_dir),
         "--out", str(live), "--record", str(rec), *ARGS]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "KL(teacher \\|\\| student)" in printed and "student cross-entropy" in printed
    result = _result(live)
    before, after = result["before"], result["after"]
    assert after["kl_teacher_student"] < 0.5 * before["kl_teacher_student"], (before, after)
    assert after["student_ce"] < before["student_ce"]
    assert len(result["train_loss"]) == 24 and result["curve_steps"] == [0, 12, 24]
    png = live / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rec.stat().st_size > 0

    replayed = tmp_path / "replayed"
    code = distill.main(
        ["--replay", str(rec), "--teacher-dir", str(teacher_dir), "--out", str(replayed), *ARGS]
    )
    assert code == 0
    again = _result(replayed)
    # Same payloads, same seeds, same CPU kernels: the same training run.
    assert again["train_loss"] == pytest.approx(result["train_loss"], rel=1e-5)
    assert again["after"]["kl_teacher_student"] == pytest.approx(
        after["kl_teacher_student"], rel=1e-4
    )

    shuffled = tmp_path / "dataset"
    code = distill.main(
        ["--dataset", str(rec), "--teacher-dir", str(teacher_dir), "--out", str(shuffled), *ARGS]
    )
    assert code == 0
    ds_result = _result(shuffled)
    assert len(ds_result["train_loss"]) == 24
    assert ds_result["after"]["kl_teacher_student"] < 0.5 * before["kl_teacher_student"]


def test_onpolicy_reduces_heldout_kl_with_response_only_traffic(
    pretrained_teacher: ServerProcess,
    teacher_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/onpolicy.py, short: the student samples, the teacher scores only the
    response rows, and held-out KL goes down; the traffic is the response rows' only."""
    from examples import onpolicy

    args = [
        "--teacher", pretrained_teacher.target, "--teacher-dir", str(teacher_dir),
        "--out", str(tmp_path), "--steps", "12", "--batch-size", "8", "--min-prompt", "16",
        "--max-prompt", "32", "--response", "32", "--eval-windows", "8", "--eval-len", "128",
    ]  # fmt: skip
    assert onpolicy.main(args) == 0
    assert "saved by the sub-range" in capsys.readouterr().out
    result = _result(tmp_path)
    before, after = result["before"], result["after"]
    assert after["kl_teacher_student"] < 0.9 * before["kl_teacher_student"], (before, after)
    config = json.loads((tmp_path / "result.json").read_text())["config"]
    assert config["divergence"] == "reverse"  # the example's default
    assert after["kl_student_teacher"] < before["kl_student_teacher"], (before, after)
    assert len(result["train_loss"]) == 12
    # 32 response rows per sample are scored; full sequences would be 48-64 rows.
    assert result["response_rows"] == 12 * 8 * 32
    assert 48 * 12 * 8 <= result["full_rows"] <= 64 * 12 * 8
    assert result["payload_bytes"] == result["response_rows"] * 16 * (4 + 2)
    assert result["payload_bytes"] < 0.7 * result["full_sequence_bytes"]


def test_onpolicy_union_support_sends_the_students_candidates(
    pretrained_teacher: ServerProcess,
    teacher_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/onpolicy.py --support union: the student's top-8 at every response row
    travel with the request, the teacher's log-probs at them come back, and the reverse
    KL on the union of both supports lowers held-out KL in both directions."""
    from examples import onpolicy

    args = [
        "--teacher", pretrained_teacher.target, "--teacher-dir", str(teacher_dir),
        "--out", str(tmp_path), "--steps", "12", "--batch-size", "8", "--min-prompt", "16",
        "--max-prompt", "32", "--response", "32", "--eval-windows", "8", "--eval-len", "128",
        "--support", "union", "--candidates", "8",
    ]  # fmt: skip
    assert onpolicy.main(args) == 0
    assert "student's top-8" in capsys.readouterr().out
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["config"]["support"] == "union"
    result = saved["result"]
    before, after = result["before"], result["after"]
    assert after["kl_student_teacher"] < 0.9 * before["kl_student_teacher"], (before, after)
    assert after["kl_teacher_student"] < before["kl_teacher_student"], (before, after)
    rows = result["response_rows"]
    assert rows == 12 * 8 * 32
    # Down: top-16 ids (4 B) and float16 log-probs (2 B), plus 8 float16 candidate log-probs.
    assert result["payload_bytes"] == rows * (16 * (4 + 2) + 8 * 2)
    # Up: the candidate ids alone are 8 x 4 bytes per response row.
    assert result["request_bytes"] > rows * 8 * 4


def test_onpolicy_group_size_computes_each_prompt_once(
    pretrained_teacher: ServerProcess,
    teacher_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/onpolicy.py --group-size 4: a batch of 8 is 2 prompts x 4 samples; the
    teacher (prefix reuse on, blocks of 128 tokens) computes the first 128-token block of
    each prompt once, not 4 times, and the run reports computed vs answered positions."""
    from examples import onpolicy

    steps, batch, group, response, block = 6, 8, 4, 32, 128
    args = [
        "--teacher", pretrained_teacher.target, "--teacher-http", pretrained_teacher.http,
        "--teacher-dir", str(teacher_dir), "--out", str(tmp_path), "--steps", str(steps),
        "--batch-size", str(batch), "--group-size", str(group), "--min-prompt", "140",
        "--max-prompt", "160", "--response", str(response), "--eval-windows", "8",
        "--eval-len", "128",
    ]  # fmt: skip
    assert onpolicy.main(args) == 0
    assert "positions computed for" in capsys.readouterr().out
    result = _result(tmp_path)
    assert result["teacher_positions_answered"] == steps * batch * response
    # Every sequence is sent whole; the 3 siblings of each prompt read its first block.
    read = steps * (batch // group) * (group - 1) * block
    assert result["teacher_positions_computed"] <= result["full_rows"] - read
    assert result["after"]["kl_student_teacher"] < result["before"]["kl_student_teacher"]


def test_student_candidates_go_to_the_rows_that_predict_the_response() -> None:
    """Step j of ``generate`` predicts column P + j, so its top-C goes to row P - 1 + j."""
    import torch

    from examples.onpolicy import student_candidates

    steps = tuple(torch.arange(5.0).roll(j).unsqueeze(0).repeat(2, 1) for j in range(3))
    out = student_candidates(steps, total=7, first_row=3, count=2)
    assert out.shape == (2, 7, 2)
    assert (out[:, :3] == -1).all() and (out[:, 6:] == -1).all()
    assert out[0, 3].tolist() == [4, 3] and out[0, 4].tolist() == [0, 4]
    assert out[1, 5].tolist() == [1, 0]
