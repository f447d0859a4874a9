"""The payload quality table's harness, at a tiny size (a BPE teacher of 384 ids trained
for 3 steps, 2 distillation steps per kind): every kind runs, its bytes are those of the
real messages, the student trains on the decoded values, and the planned kinds are
refused by name rather than faked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.quality_divergences import topk_payload
from benchmarks.quality_payloads import (
    KINDS,
    PLANNED_KINDS,
    SCALE_VOCAB,
    KindResult,
    main,
    projected_bytes,
    topk_kind,
)
from examples.distill import EvalResult
from examples.teacher_pretrain import PretrainConfig, build_default_teacher
from topk_protocol import RequestOptions
from topk_protocol.codec import DTYPE_NAMES
from topk_protocol.requests import bytes_per_row

SEQ_LEN = 16


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = PretrainConfig(
        tokenizer="bpe", vocab_size=384, train_seconds=0, max_steps=3, batch_size=4,
        seq_len=32, eval_windows=2, warmup_steps=1, corpus_max_bytes=150_000,
    )  # fmt: skip
    return build_default_teacher(tmp_path_factory.mktemp("cache") / "bpe", config=cfg)


def test_tiny_run_writes_a_row_per_kind_with_measured_bytes(
    teacher_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        "--teacher-dir", str(teacher_dir), "--steps", "2", "--batch-size", "2",
        "--seq-len", str(SEQ_LEN), "--eval-windows", "2", "--scale-positions", "16",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "quality_payloads.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == list(KINDS) and not set(rows) & set(PLANNED_KINDS)
    assert report["vocab_size"] == 384
    for name, row in rows.items():
        k = int(name.split("-")[0].removeprefix("top"))
        arrays = RequestOptions(top_k=k).bytes_per_row()
        # The arrays plus each window's message framing (a few varint fields).
        assert arrays < row["bytes_per_position"] < arrays + 32 / SEQ_LEN, name
        assert row["packed_ids_per_position"] == 0
        assert row["scale_bytes_per_position"] == row["bytes_per_position"]
        after = row["after"]
        assert all(math.isfinite(after[m]) for m in ("student_ce", "kl_teacher_student"))
        assert after["kl_teacher_student"] > 0 and after["kl_student_teacher"] > 0
        assert row["record_us_per_position"] > 0 and row["scale_record_us_per_position"] > 0
    table = (out / "quality_payloads.md").read_text()
    assert all(f"| {name} |" in table for name in KINDS)
    assert not any(name in table for name in PLANNED_KINDS)
    # The same steps, windows and seed: the two top-6 kinds differ only in their loss.
    six = rows["top6-tail"], rows["top6-tail_actual"]
    assert six[0]["bytes_per_position"] == six[1]["bytes_per_position"]
    assert six[0]["after"]["kl_teacher_student"] != six[1]["after"]["kl_teacher_student"]


@pytest.mark.parametrize("name", PLANNED_KINDS)
def test_planned_kinds_are_refused_by_name(name: str) -> None:
    with pytest.raises(SystemExit, match=f"{name}.*not implemented"):
        main(["--kinds", "top8-tail", name])


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown kind 'top3-everything'"):
        main(["--kinds", "top3-everything"])


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAMES))
def test_topk_kind_trains_on_the_decoded_wire_values(dtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(3 * torch.randn(3, 47, 123, generator=gen), dim=-1)
    x = torch.randint(0, 123, (3, 47), generator=gen)
    kind = topk_kind(8, "tail_actual", dtype)
    recorded = kind.record(log_p, x, gen)
    assert recorded.payload_bytes == sum(m.ByteSize() for m in recorded.payload)
    assert recorded.payload_bytes >= 3 * 47 * bytes_per_row(8, DTYPE_NAMES[dtype], True)
    inputs = kind.read(recorded)
    top = topk_payload(log_p, x, 8)
    assert torch.equal(inputs["ids"], top["ids"])
    exact = dtype == "float32"
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(inputs["logprobs"], top["logprobs"], **tol)
    assert exact == torch.equal(inputs["logprobs"], top["logprobs"])
    assert torch.isnan(inputs["sampled"][:, -1]).all()
    torch.testing.assert_close(inputs["sampled"][:, :-1], top["sampled"][:, :-1], **tol)


def test_projected_bytes_scale_packed_ids_with_log2_vocab() -> None:
    def row(bytes_per_position: float, packed: float) -> KindResult:
        nan = EvalResult(math.nan, math.nan, math.nan)
        return KindResult("k", "k", nan, bytes_per_position, packed, 1.0, 1.0)

    assert projected_bytes(row(386.2, 0), 8192) == 386.2  # int32 ids: no change
    # 64 ids at 13 bits (V = 8192) -> 18 bits (V = 151,936): 64 x 5 / 8 = 40 bytes more.
    assert projected_bytes(row(200.0, 64), 8192) == 240.0
    assert math.ceil(np.log2(SCALE_VOCAB)) == 18
    assert projected_bytes(row(10.0, 12), 512, scale_vocab=513) == 10.0 + 12 / 8  # 9 -> 10 bits
