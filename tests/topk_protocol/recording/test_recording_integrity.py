"""Damaged recordings: a flipped byte anywhere in a shard, a metadata.json that lies or is
garbage. Every case gives a typed error or the intact rows, never different data."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from recording_fakes import INFO, K, teacher_answer

from student_client.offline.replay_client import ReplayClient
from topk_protocol import SequenceArrays
from topk_protocol.errors import DataLossError, RecordingDamagedError, RecordingError
from topk_protocol.recording import (
    METADATA_FILE,
    RecordingReader,
    RecordingWriter,
)
from topk_protocol.recording.integrity import CHECKSUM_COLUMN

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "data" / "tiny_vllm_recording"  # written before checksums
CHECKSUMMED = ROOT / "tests" / "data" / "checksummed_recording"


def _write(path: Path, compression: str, dtype: str = "float16", n: int = 6) -> None:
    """n rows in 2 batches; every other row without sampled log-probs."""
    with RecordingWriter(
        path, INFO, top_k=K, dtype=dtype, compression=compression, flush_interval_s=1000
    ) as w:
        for i in range(n):
            tokens, s = teacher_answer(9 + 5 * i, seed=50 + i)
            a = i % 3  # rows [a, L) of the sequence
            row = s.rows(a, len(s))
            w.add(tokens, row if i % 2 else replace(row, sampled_logprobs=None), dtype="float32")
            if i == n // 2:
                w.flush()


def _snapshot(r: RecordingReader) -> dict[bytes, tuple[bytes, ...]]:
    """token ids -> the bytes of everything a row serves."""
    return {tokens.tobytes(): _row_bytes(row) for tokens, row in r}


def _row_bytes(row: SequenceArrays) -> tuple[bytes, ...]:
    sp = b"-" if row.sampled_logprobs is None else row.sampled_logprobs.tobytes()
    return (
        np.array([row.position_start, row.position_end]).tobytes(),
        row.ids.tobytes(),
        str(row.logprobs.dtype).encode(),
        row.logprobs.tobytes(),
        sp,
    )


def _served(path: Path, want: dict[bytes, tuple[bytes, ...]], spans: dict[bytes, Any]) -> str:
    """Open the (possibly damaged) recording and ask for every recorded row: each answer
    must be the recorded bytes or a typed error. Returns the outcome's kind."""
    try:
        r = RecordingReader(path)
    except RecordingError:
        return "refused"
    outcome = "intact"
    with r:
        for tokens, expected in want.items():
            start, end, sampled = spans[tokens]
            try:
                got = r.find(tokens, start, end, sampled)
            except RecordingDamagedError as e:
                assert e.path.name.endswith(".arrow") and e.row is not None, e
                outcome = "row error"
                continue
            if isinstance(got, str):  # not found: the damaged part was passed over
                outcome = "rows missing" if outcome == "intact" else outcome
                continue
            assert _row_bytes(got) == expected, f"different data served for a row of {path}"
        if r.damaged and outcome == "intact":
            outcome = "damage reported"
    return outcome


@pytest.mark.filterwarnings("ignore::UserWarning")  # each damaged open warns
@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_every_flipped_byte_gives_a_typed_error_or_the_intact_rows(
    tmp_path: Path, compression: str
) -> None:
    clean = tmp_path / "clean"
    _write(clean, compression)
    with RecordingReader(clean) as r:
        assert r.damaged == [] and r.unverified == [] and len(r) == 6
        want = _snapshot(r)
        spans = {
            tokens.tobytes(): (
                row.position_start,
                row.position_end,
                row.sampled_logprobs is not None,
            )
            for tokens, row in r
        }
    work = tmp_path / "work"
    shutil.copytree(clean, work)
    (shard,) = sorted(work.glob("*.arrow"))
    data = shard.read_bytes()
    # Every byte of the first 600 (the schema, the first batch's header), then a sample
    # across the rest (buffers of every column, the second batch, the end of stream).
    offsets = sorted({*range(600), *range(600, len(data), 11), len(data) - 1})
    outcomes: dict[str, int] = {}
    for off in offsets:
        flipped = bytearray(data)
        flipped[off] ^= 0xFF
        shard.write_bytes(bytes(flipped))
        kind = _served(work, want, spans)
        outcomes[kind] = outcomes.get(kind, 0) + 1
    print(f"{compression}: {len(data)} bytes, {len(offsets)} flips: {outcomes}")
    # Flips in padding or unused header fields change nothing served; the others must be
    # caught, and the row checks must be among what catches them.
    assert outcomes.get("row error", 0) > 0
    assert sum(outcomes.values()) == len(offsets)


def _lie(path: Path, **changes: Any) -> None:
    meta_path = path / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    for name, value in changes.items():
        if name.startswith("teacher."):
            meta["teacher"][name.removeprefix("teacher.")] = value
        else:
            meta[name] = value
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": "float32"},  # float16 values served as exact float32
        {"dtype": "bfloat16"},
        {"top_k": 8},
        {"vocab_size": 256, "teacher.vocab_size": 256},
        {"vocab_size": 1024, "teacher.vocab_size": 1024},
        {"temperature": 2.0, "teacher.teacher_temperature": 2.0},
        {"tokenizer_fingerprint": "cd" * 32, "teacher.tokenizer_fingerprint": "cd" * 32},
        {"vocab_size": 256},  # top level and teacher info disagree
        {"temperature": 0.5},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_a_lying_metadata_json_is_refused_naming_it(tmp_path: Path, changes: dict) -> None:
    path = tmp_path / "rec"
    _write(path, "zstd")
    _lie(path, **changes)
    with pytest.raises(RecordingError, match=METADATA_FILE) as err:
        RecordingReader(path)
    assert err.value.path.name == METADATA_FILE
    assert next(iter(changes)).removeprefix("teacher.") in str(err.value)


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\xff garbage", b"[1, 2]", b'{"format": "topk-distill-payloads"}', b"null", b"{"],
)
def test_garbage_metadata_json_is_refused_naming_it(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "rec"
    _write(path, "none")
    (path / METADATA_FILE).write_bytes(garbage)
    with pytest.raises(RecordingError, match=METADATA_FILE) as err:
        RecordingReader(path)
    assert err.value.path.name == METADATA_FILE


def test_wrong_field_types_in_metadata_json_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    _write(path, "none")
    for name, value in (("top_k", "16"), ("teacher", None), ("vocab_size", True)):
        clean = json.loads((path / METADATA_FILE).read_text())
        bad = {**clean, name: value}
        (path / METADATA_FILE).write_text(json.dumps(bad))
        with pytest.raises(RecordingError, match=f"{METADATA_FILE}: {name}: "):
            RecordingReader(path)
        (path / METADATA_FILE).write_text(json.dumps(clean))


def test_a_damaged_row_is_a_typed_error_naming_the_shard_and_row_others_replay(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rec"
    _write(path, "none")
    with RecordingReader(path) as r:
        rows = list(r)
        target_tokens, target = rows[4]
        victim = target.logprobs.astype(np.float16).tobytes()  # as the shard stores it
    (shard,) = sorted(path.glob("*.arrow"))
    data = bytearray(shard.read_bytes())
    at = bytes(data).index(victim)
    data[at + 1] ^= 0x01  # one bit of one float16 of row 4 (row 1 of the second batch)
    shard.write_bytes(bytes(data))
    with ReplayClient(path) as replay, RecordingReader(path) as r:
        assert r.verify() and all(e.row == 4 for e in r.verify())
        with pytest.raises(RecordingDamagedError, match=rf"{shard.name}: row 4: checksum") as e:
            replay.score(
                [target_tokens],
                K,
                positions=[(target.position_start, target.position_end)],
                include_sampled=False,
            )
        assert isinstance(e.value, DataLossError) and e.value.path == shard
        for tokens, row in rows[:4]:  # the intact rows still replay
            p = replay.score(
                [tokens],
                K,
                positions=[(row.position_start, row.position_end)],
                include_sampled=False,
            )
            assert np.array_equal(p.ids[0].numpy(), row.ids)


def test_an_old_recording_without_checksums_opens_with_one_warning() -> None:
    with pytest.warns(UserWarning, match="without checksums") as caught:
        r = RecordingReader(FIXTURE)
    with r:
        assert len(caught) == 1 and r.unverified and r.damaged == []
        assert len(list(r)) == len(r)  # still checked for lengths and the vocabulary


def test_a_lying_metadata_json_of_an_old_recording_is_refused(tmp_path: Path) -> None:
    """Old shards state only K and dtype in their schema; the vocabulary is checked
    against the ids as rows are read."""
    for changes in ({"dtype": "float16"}, {"top_k": 32}):
        path = tmp_path / f"old-{next(iter(changes))}"
        shutil.copytree(FIXTURE, path)
        _lie(path, **changes)
        with pytest.raises(RecordingDamagedError, match=METADATA_FILE):
            RecordingReader(path)
    path = tmp_path / "old-vocab"
    shutil.copytree(FIXTURE, path)
    _lie(path, vocab_size=64, **{"teacher.vocab_size": 64})
    with (
        pytest.warns(UserWarning),
        RecordingReader(path) as r,
        pytest.raises(
            RecordingDamagedError, match=f"outside the vocabulary .0, 64. of {METADATA_FILE}"
        ),
    ):
        list(r)


def test_checksums_are_a_column_plain_readers_see(tmp_path: Path) -> None:
    import pyarrow as pa

    path = tmp_path / "rec"
    _write(path, "zstd")
    (shard,) = sorted(path.glob("*.arrow"))
    table = pa.ipc.open_stream(str(shard)).read_all()
    assert table.column(CHECKSUM_COLUMN).type == pa.uint32()
    assert json.loads(table.schema.metadata[b"topk_distill"])["vocab_size"] == INFO.vocab_size


def test_a_checksummed_recording_of_the_previous_writer_still_verifies() -> None:
    """Written (K 4, float16, zstd) by the writer before ``SequenceArrays`` listed the
    array columns generically: its row checksums still match, and its rows read back as
    the values it was given (sequence ``i``: ``teacher_answer(5 + 3 i, seed=200 + i)``,
    rows ``[i % 2, L)``, sampled log-probs on even rows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = RecordingReader(CHECKSUMMED)
    with r:
        assert r.verify() == [] and r.unverified == [] and len(r) == 4
        for i, (tokens, row) in enumerate(r):
            want_tokens, full = teacher_answer(5 + 3 * i, seed=200 + i)
            want = full.rows(i % 2, len(full)).top(4)
            assert np.array_equal(tokens, want_tokens)
            assert (row.position_start, row.position_end) == (want.position_start, len(full))
            assert np.array_equal(row.ids, want.ids)
            f16 = want.logprobs.astype(np.float16).astype(np.float32)
            assert row.logprobs.tobytes() == f16.tobytes()
            assert (row.sampled_logprobs is not None) == (i % 2 == 0)
