"""``teacher-record`` inputs: every supported corpus format gives the same sequences, and
bad input is refused naming the problem (the live-teacher run is in test_replay_client.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from student_client.offline.record_cli import main, read_token_sequences

SEQS = [[1, 2, 3], [7], [300, 4, 5, 6]]


def test_every_input_format_reads_the_same_sequences(tmp_path: Path) -> None:
    import datasets

    table = pa.table({"text": ["a", "b", "c"], "input_ids": SEQS})
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in SEQS))
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SEQS) + "\n")
    datasets.Dataset.from_dict({"token_ids": SEQS}).save_to_disk(str(tmp_path / "ds"))
    for name in ("t.parquet", "t.arrow", "s.arrow", "t.jsonl", "l.jsonl", "ds"):
        got = [s.tolist() for s in read_token_sequences(tmp_path / name)]
        assert got == SEQS, name


def test_bad_input_is_refused_by_name(tmp_path: Path) -> None:
    pq.write_table(pa.table({"ids": SEQS}), tmp_path / "t.parquet")
    with pytest.raises(SystemExit, match=r"no token column .* pass --column"):
        read_token_sequences(tmp_path / "t.parquet")
    assert read_token_sequences(tmp_path / "t.parquet", "ids")[2].tolist() == SEQS[2]
    (tmp_path / "bad.jsonl").write_text('[1, 2]\n["x"]\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl: the line at byte 7: expected a list of ints"):
        read_token_sequences(tmp_path / "bad.jsonl")
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(SystemExit, match=r"use \.parquet, \.arrow, \.jsonl"):
        read_token_sequences(tmp_path / "x.csv")


def test_bad_packed_options_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    from student_client.offline.record_cli import main

    args = ["--teacher", "127.0.0.1:1", "--input", str(tmp_path / "absent.parquet")]
    args += ["--output", str(tmp_path / "out"), "--encoding", "packed", "--logprob-bits", "20"]
    with pytest.raises(SystemExit, match=r"teacher-record: logprob_bits: 20 is outside \[1, 16\]"):
        main(args)
    with pytest.raises(SystemExit, match="logprob_bits: 8 asked with encoding 'default'"):
        main([*args[:6], "--logprob-bits", "8"])


def test_bad_sampling_flags_are_refused_by_name(tmp_path: Path) -> None:
    base = [
        "--teacher",
        "127.0.0.1:1",
        "--input",
        str(tmp_path / "x.jsonl"),
        "--output",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit, match=r"teacher-record: samples: 300 is outside \[0, 255\]"):
        main([*base, "--samples", "300", "--seed", "1"])
    with pytest.raises(SystemExit, match=r"teacher-record: seed: required with samples 16"):
        main([*base, "--samples", "16"])
    with pytest.raises(SystemExit, match=r"teacher-record: seed: applies to sampled payloads only"):
        main([*base, "--seed", "3"])
