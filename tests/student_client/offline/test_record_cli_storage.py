"""``teacher-record --output s3://...`` against a real S3-compatible server (moto's server
mode on loopback) and a real teacher: the rows equal a local recording's and a re-run
resumes; an input on the store is recorded by two shards into parts on the store and
verified; an unreachable bucket or endpoint is refused naming ``--output`` (or
``--input``), quickly, before any teacher is asked."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from object_store import closed_port

from student_client.offline.dataset import PayloadDataset
from student_client.offline.record_cli import main as record_main
from topk_protocol.recording import RecordingReader
from topk_protocol.recording.sharded import list_parts
from topk_protocol.storage import Location


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    path = tmp_path / "tokens.jsonl"
    seqs = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(3, 47, size=9)]
    path.write_text("".join(json.dumps(s) + "\n" for s in seqs))
    return path


def test_teacher_record_writes_to_s3_and_resumes(
    s3_bucket: str,
    tiny_model_dir: Path,
    teacher_factory: Callable[..., object],
    corpus: Path,
    tmp_path: Path,
) -> None:
    server = teacher_factory(["--backend", "transformers", "--model", str(tiny_model_dir)])
    uri = f"{s3_bucket}/scored"
    for output in (uri, str(tmp_path / "local")):
        args = ["--teacher", server.target, "--input", str(corpus), "--output", output]  # type: ignore[attr-defined]
        assert record_main([*args, "--top-k", "8", "--batch-size", "4"]) == 0
    objects = Location.of(uri).files(".arrow")
    assert record_main([*args[:-1], uri, "--top-k", "8"]) == 0  # resumed: nothing left
    assert Location.of(uri).files(".arrow") == objects
    remote, local = PayloadDataset(uri), PayloadDataset(tmp_path / "local")
    key = lambda item: item.token_ids.numpy().tobytes()  # noqa: E731
    got = {key(remote[i]): remote[i] for i in range(len(remote))}
    assert len(got) == len(local) == 9
    for i in range(len(local)):
        want = local[i]
        assert got[key(want)].arrays.logprobs.tobytes() == want.arrays.logprobs.tobytes()
        assert got[key(want)].arrays.ids.tobytes() == want.arrays.ids.tobytes()
    with RecordingReader(uri) as r:
        assert r.skipped == [] and r.verify() == []


@pytest.mark.parametrize(
    ("output", "says"),
    [
        ("s3://no-such-bucket/scored", "bucket 'no-such-bucket' does not exist"),
        ("s3://bkt/scored?endpoint_override=127.0.0.1:{port}&scheme=http", "connect"),
    ],
)
def test_an_unreachable_output_is_refused_naming_the_flag(
    s3_endpoint: str, corpus: Path, output: str, says: str
) -> None:
    output = output.format(port=closed_port())
    t0 = time.monotonic()
    # no teacher listens at this target: the output is checked before one is asked
    args = ["--teacher", f"127.0.0.1:{closed_port()}", "--input", str(corpus)]
    with pytest.raises(SystemExit) as err:
        record_main([*args, "--output", output])
    message = str(err.value)
    assert message.startswith(f"teacher-record: --output {output}: ")
    assert says in message.lower()
    assert time.monotonic() - t0 < 30


def test_two_shards_read_s3_and_write_s3_and_verify_accepts_them(
    s3_bucket: str,
    tiny_model_dir: Path,
    teacher_factory: Callable[..., object],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Parquet input on the store, two recorders (``--num-shards 2``) writing parts to
    the store, ``--verify`` of the store's recording: every input row once."""
    rng = np.random.default_rng(8)
    seqs = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(3, 30, size=11)]
    pq.write_table(pa.table({"input_ids": seqs}), tmp_path / "in.parquet", row_group_size=3)
    source = f"{s3_bucket}/corpus/in.parquet"
    Location.of(source).write_bytes_atomic((tmp_path / "in.parquet").read_bytes())
    server = teacher_factory(["--backend", "transformers", "--model", str(tiny_model_dir)])
    output = f"{s3_bucket}/scored"
    args = ["--teacher", server.target, "--input", source, "--output", output]  # type: ignore[attr-defined]
    for index in (0, 1):
        shard = ["--num-shards", "2", "--shard-index", str(index), "--quiet"]
        assert record_main([*args, *shard, "--top-k", "8", "--batch-size", "2"]) == 0
    assert [p.name for p in list_parts(output)] == ["part-00000-of-00002", "part-00001-of-00002"]
    capsys.readouterr()
    assert record_main(["--verify", output]) == 0
    assert "OK: 2 part(s), 11 rows" in capsys.readouterr().out
    ds = PayloadDataset(output)
    assert [ds[i].token_ids.tolist() for i in range(len(ds))] == seqs


def test_an_unreachable_input_is_refused_naming_the_flag(s3_endpoint: str, tmp_path: Path) -> None:
    source = f"s3://bkt/in.parquet?endpoint_override=127.0.0.1:{closed_port()}&scheme=http"
    args = ["--teacher", f"127.0.0.1:{closed_port()}", "--output", str(tmp_path / "out")]
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as err:
        record_main([*args, "--input", source])
    assert str(err.value).startswith(f"teacher-record: --input {source}: ")
    assert time.monotonic() - t0 < 30
