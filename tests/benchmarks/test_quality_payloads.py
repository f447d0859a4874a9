"""The payload quality table's harness, at a tiny size (a BPE teacher of 384 ids trained
for 3 steps, 2 distillation steps per kind): every kind runs, its bytes are those of the
real messages (top-k, packed top-k, sampled), the student trains on the decoded values,
and the sampled kinds draw as a teacher does, from the step's seed."""

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
    SCALE_VOCAB,
    KindResult,
    main,
    packed_kind,
    projected_bytes,
    sampled_kind,
    topk_kind,
)
from examples.distill import EvalResult
from examples.teacher_pretrain import PretrainConfig, build_default_teacher
from topk_protocol import RequestOptions
from topk_protocol.codec import DTYPE_NAMES
from topk_protocol.packing import id_bits, packed_payload_bytes, packed_roundtrip
from topk_protocol.requests import bytes_per_row
from topk_protocol.sampling import sample_rows, sequence_sample_key

SEQ_LEN = 16
VOCAB = 384


def _array_bytes(name: str) -> tuple[float, int]:
    """A default kind's array bytes per position and packed ids per position."""
    if name.startswith("sampled"):
        n = int(name.removeprefix("sampled"))
        return RequestOptions(top_k=n, samples=n, seed=0).bytes_per_row(), 0
    k = int(name.split("-")[0].removeprefix("top"))
    if name.endswith("-packed"):
        return packed_payload_bytes(SEQ_LEN, k, VOCAB) / SEQ_LEN, k
    return RequestOptions(top_k=k).bytes_per_row(), 0


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = PretrainConfig(
        tokenizer="bpe", vocab_size=VOCAB, train_seconds=0, max_steps=3, batch_size=4,
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
    assert list(rows) == list(KINDS)
    assert {"top64-packed", "sampled16", "sampled50"} <= set(rows)
    assert report["vocab_size"] == VOCAB
    for name, row in rows.items():
        arrays, packed = _array_bytes(name)
        # The arrays plus each window's message framing (a few varint fields).
        assert arrays < row["bytes_per_position"] < arrays + 40 / SEQ_LEN, name
        assert row["packed_ids_per_position"] == packed
        extra = packed * (math.ceil(np.log2(SCALE_VOCAB)) - id_bits(VOCAB)) / 8
        assert row["scale_bytes_per_position"] == row["bytes_per_position"] + extra
        after = row["after"]
        assert all(math.isfinite(after[m]) for m in ("student_ce", "kl_teacher_student"))
        assert after["kl_teacher_student"] > 0 and after["kl_student_teacher"] > 0
        assert row["record_us_per_position"] > 0 and row["scale_record_us_per_position"] > 0
    table = (out / "quality_payloads.md").read_text()
    assert all(f"| {name} |" in table for name in KINDS)
    # The same steps, windows and seed: the two top-6 kinds differ only in their loss.
    six = rows["top6-tail"], rows["top6-tail_actual"]
    assert six[0]["bytes_per_position"] == six[1]["bytes_per_position"]
    assert six[0]["after"]["kl_teacher_student"] != six[1]["after"]["kl_teacher_student"]


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


def _odd_payload(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(3 * torch.randn(3, 47, 123, generator=gen), dim=-1)
    return log_p, torch.randint(0, 123, (3, 47), generator=gen)


def test_packed_kind_trains_on_the_packed_grid_values() -> None:
    log_p, x = _odd_payload()
    kind = packed_kind(8)
    recorded = kind.record(log_p, x, torch.Generator().manual_seed(0))
    assert recorded.payload_bytes == sum(m.ByteSize() for m in recorded.payload)
    assert recorded.packed_ids == 3 * 47 * 8
    # ids at 7 bits (V = 123), 6 codes of 8 bits, float16 ends and next token's log-prob.
    arrays = 3 * packed_payload_bytes(47, 8, 123)
    assert arrays < recorded.payload_bytes < arrays + 3 * 32
    inputs = kind.read(recorded)
    top = topk_payload(log_p, x, 8)
    assert torch.equal(inputs["ids"], top["ids"])
    assert torch.equal(inputs["logprobs"], packed_roundtrip(top["logprobs"]))
    assert not torch.equal(inputs["logprobs"], top["logprobs"].half().float())


def test_sampled_kind_draws_as_the_teacher_from_the_step_seed() -> None:
    log_p, x = _odd_payload()
    kind = sampled_kind(5)
    recorded = kind.record(log_p, x, torch.Generator().manual_seed(7))
    assert recorded.payload_bytes == sum(m.ByteSize() for m in recorded.payload)
    assert recorded.packed_ids == 0
    arrays = 3 * 47 * RequestOptions(top_k=5, samples=5, seed=0).bytes_per_row()  # + counts
    assert arrays < recorded.payload_bytes < arrays + 3 * 32
    inputs = kind.read(recorded)
    assert inputs["counts"].sum(-1).eq(5).all()
    for b in range(3):
        rows = sample_rows(log_p[b], 5, 7, sequence_sample_key(x[b].numpy()), torch.arange(47))
        assert torch.equal(inputs["ids"][b], rows.ids)
        assert torch.equal(inputs["counts"][b], rows.counts)
        torch.testing.assert_close(inputs["logprobs"][b], rows.logprobs.half().float())
    same = kind.read(kind.record(log_p, x, torch.Generator().manual_seed(7)))
    other = kind.read(kind.record(log_p, x, torch.Generator().manual_seed(8)))
    assert torch.equal(same["ids"], inputs["ids"])
    assert not torch.equal(other["ids"], inputs["ids"])
