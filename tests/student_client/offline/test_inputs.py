"""Streaming corpus readers: every format and every shard count gives the input's rows, each
exactly once and in input order, a few rows at a time; unreadable units are named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from student_client.offline import inputs
from student_client.offline.inputs import InputError, open_input, shard_range

rng = np.random.default_rng(7)
SEQS = [rng.integers(0, 512, size=int(n)).tolist() for n in rng.integers(1, 40, size=123)]
TEACHERS = [f"t{i % 3}" for i in range(len(SEQS))]


def _write_all(tmp_path: Path) -> dict[str, str]:
    """The corpus in every format, several units each; name -> location."""
    import datasets

    table = pa.table({"text": ["x"] * len(SEQS), "input_ids": SEQS, "teacher_id": TEACHERS})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=10)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=11)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    rows = zip(SEQS, TEACHERS, strict=True)
    lines = [json.dumps({"tokens": s, "teacher_id": t}) for s, t in rows]
    (tmp_path / "t.jsonl").write_text("\n".join(lines[:50]) + "\n\n" + "\n".join(lines[50:]))
    ds = datasets.Dataset.from_dict({"token_ids": SEQS, "teacher_id": TEACHERS})
    ds.save_to_disk(str(tmp_path / "saved"), max_shard_size=2000)
    (tmp_path / "files").mkdir()
    for i in range(0, len(SEQS), 30):  # a directory of Parquet files, read streaming
        pq.write_table(table.slice(i, 30), tmp_path / "files" / f"part-{i:04d}.parquet")
    return {
        "parquet": str(tmp_path / "t.parquet"),
        "arrow file": str(tmp_path / "f.arrow"),
        "arrow stream": str(tmp_path / "s.arrow"),
        "jsonl": str(tmp_path / "t.jsonl"),
        "saved dataset": str(tmp_path / "saved"),
        "streamed dataset": "datasets:" + str(tmp_path / "files"),
    }


def _rows(location: str, index: int, num: int) -> tuple[list[list[int]], list[str]]:
    source = open_input(location, teacher_column="teacher_id", batch_rows=4)
    try:
        units = shard_range(source.num_units, index, num)
        tokens, names = [], []
        for _, chunk in source.read(units):
            assert len(chunk.tokens) <= 4
            tokens += [t.tolist() for t in chunk.tokens]
            names += chunk.teachers or []
        return tokens, names
    finally:
        source.close()


def test_shard_range_tiles_the_units_like_datasets() -> None:
    for units in (0, 1, 5, 17):
        for num in (1, 2, 4, 7):
            ranges = [shard_range(units, i, num) for i in range(num)]
            assert [u for r in ranges for u in r] == list(range(units))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError, match=r"shard index 4 is not in \[0, 4\)"):
        shard_range(9, 4, 4)


def test_every_format_and_shard_count_gives_each_row_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inputs, "JSONL_BLOCK_BYTES", 700)  # lines cross block boundaries
    for name, location in _write_all(tmp_path).items():
        source = open_input(location)
        assert source.num_units > 4, name  # every format is read in several units
        source.close()
        for num in (1, 3, 4, 8):
            tokens: list[list[int]] = []
            names: list[str] = []
            for i in range(num):
                t, n = _rows(location, i, num)
                tokens += t
                names += n
            assert tokens == SEQS, (name, num)
            assert names == TEACHERS, (name, num)


def test_parquet_reads_only_the_token_column_and_knows_its_rows(tmp_path: Path) -> None:
    location = _write_all(tmp_path)["parquet"]
    source = open_input(location)
    assert source.rows_in(range(source.num_units)) == len(SEQS)
    assert source.rows_in(shard_range(source.num_units, 1, 4)) == 30
    source.close()


def test_bad_inputs_name_the_file_and_the_flag(tmp_path: Path) -> None:
    pq.write_table(pa.table({"ids": SEQS}), tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"no token column .* pass --column"):
        open_input(tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"--column 'nope' is not in"):
        open_input(tmp_path / "t.parquet", "nope")
    with pytest.raises(InputError, match=r"--teacher-column 'who' is not in"):
        open_input(tmp_path / "t.parquet", "ids", teacher_column="who")
    pq.write_table(pa.table({"input_ids": [1.5, 2.5]}), tmp_path / "f.parquet")
    source = open_input(tmp_path / "f.parquet")
    with pytest.raises(InputError, match=r"f.parquet: row group 0: column 'input_ids' is double"):
        list(source.read(range(1)))
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(InputError, match=r"--input .*x.csv: use \.parquet"):
        open_input(tmp_path / "x.csv")
    with pytest.raises(InputError, match=r"--input .*gone.parquet: no such file"):
        open_input(tmp_path / "gone.parquet")
    (tmp_path / "bad.jsonl").write_text('[1, 2]\n["x"]\n')
    with pytest.raises(InputError, match=r"bad.jsonl: the line at byte 7: expected a list of ints"):
        list(open_input(tmp_path / "bad.jsonl").read(range(1)))


def test_a_corrupt_row_group_is_named_and_the_ones_before_it_read(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": SEQS}), path, row_group_size=10, compression="none")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(5).column(0)
    data = bytearray(path.read_bytes())
    start = col.data_page_offset
    data[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    source = open_input(path)
    got: list[list[int]] = []
    with pytest.raises(InputError, match=r"t.parquet: row group 5 is unreadable"):
        for _, chunk in source.read(range(source.num_units)):
            got += [t.tolist() for t in chunk.tokens]
    assert got == SEQS[:50]


def test_candidate_column_is_read_with_its_rows_in_every_format(tmp_path: Path) -> None:
    """One ``[L, C]`` array per row (each row its own C), chunk by chunk; a row whose id
    lists do not match its tokens, or differ in length, is refused naming the flag."""
    import datasets

    seqs = SEQS[:23]
    cands = [rng.integers(-1, 512, size=(len(s), 1 + i % 4)).tolist() for i, s in enumerate(seqs)]
    table = pa.table({"input_ids": seqs, "cands": cands})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=5)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=7)
    lines = [json.dumps({"input_ids": s, "cands": c}) for s, c in zip(seqs, cands, strict=True)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    datasets.Dataset.from_dict({"input_ids": seqs, "cands": cands}).save_to_disk(
        str(tmp_path / "saved"), max_shard_size=2000
    )
    for name in ("t.parquet", "f.arrow", "t.jsonl", "saved"):
        source = open_input(tmp_path / name, candidate_column="cands", batch_rows=3)
        got_tokens, got = [], []
        for _, chunk in source.read(range(source.num_units)):
            assert chunk.candidates is not None and len(chunk.candidates) <= 3
            assert all(c.dtype == np.int32 for c in chunk.candidates)
            got_tokens += [t.tolist() for t in chunk.tokens]
            got += [c.tolist() for c in chunk.candidates]
        source.close()
        assert got_tokens == seqs and got == cands, name
    bad = {"short": [cands[0][:-1]], "ragged": [[[1, 2], [3], *cands[0][2:]]]}
    for kind, column in bad.items():
        pq.write_table(pa.table({"input_ids": seqs[:1], "cands": column}), tmp_path / "b.parquet")
        (tmp_path / "b.jsonl").write_text(json.dumps({"input_ids": seqs[0], "cands": column[0]}))
        for name in ("b.parquet", "b.jsonl"):
            source = open_input(tmp_path / name, candidate_column="cands")
            says = "id lists for" if kind == "short" else "different lengths"
            with pytest.raises(InputError, match=rf"--candidate-column 'cands'.*{says}"):
                list(source.read(range(source.num_units)))
            source.close()
    with pytest.raises(InputError, match=r"--candidate-column 'nope' is not in"):
        open_input(tmp_path / "t.parquet", candidate_column="nope")
