"""``teacher-record`` as N sharded recorders against a real teacher on loopback (the
transformers backend on the tiny model): a SIGKILLed and re-run shard, ``--verify``, the
union read by ``PayloadDataset``, ``datasets`` and pyarrow, and bad input refused by name
with nothing recorded lost."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, ServerProcess, start_server

from student_client.offline.dataset import PayloadDataset
from student_client.offline.record_cli import main as record_main
from topk_protocol.recording import RecordingReader

K = 8
rng = np.random.default_rng(11)
SEQS = [rng.integers(0, 512, size=int(n)).tolist() for n in rng.integers(24, 200, size=480)]
SEQS[300] = SEQS[7]  # a repeat, in another shard's range


@pytest.fixture(scope="module")
def teacher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("teacher") / "server.log"
    args = ["--backend", "transformers", "--model", str(tiny_model_dir), "--max-top-k", "16"]
    server = start_server(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": SEQS}), path, row_group_size=20)
    return path


def _cmd(teacher: ServerProcess, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "student_client.offline.record_cli", "--teacher", teacher.target,
        "--top-k", str(K), "--quiet", *args,
    ]  # fmt: skip


class _Result:
    """``main(argv)`` run in this process: exit code, stdout, stderr (a SystemExit's
    message included)."""

    def __init__(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        try:
            self.returncode = record_main(argv)
        except SystemExit as e:
            self.returncode = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        captured = capsys.readouterr()
        self.stdout, self.stderr = captured.out, captured.err


def _in(teacher: ServerProcess, capsys: pytest.CaptureFixture[str], *args: str) -> _Result:
    return _Result(_cmd(teacher, *args)[3:], capsys)


def _verify(out: Path, capsys: pytest.CaptureFixture[str]) -> _Result:
    return _Result(["--verify", str(out)], capsys)


def _rows(path: Path) -> list[tuple[bytes, ...]]:
    """Every row's stored bytes, in the dataset's order."""
    ds = PayloadDataset(path, include_sampled=True)
    out = []
    for i in range(len(ds)):
        item = ds[i]
        a = item.arrays
        assert a.sampled_logprobs is not None
        out.append(
            (item.token_ids.numpy().tobytes(), a.ids.tobytes(), a.logprobs.tobytes(),
             a.sampled_logprobs.tobytes(), bytes([a.position_start]))
        )  # fmt: skip
    return out


def test_four_shards_one_killed_and_rerun_equal_one_recorder(
    teacher: ServerProcess, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sharded"
    # Shard 1, by its Indexed-Job environment, is SIGKILLed mid-recording: the teacher is
    # stopped (SIGSTOP) right after the shard's first answer, so requests hang in flight
    # while the writer flushes what was answered; then the recorder is killed.
    env = {"JOB_COMPLETION_INDEX": "1", "TOPK_RECORD_NUM_SHARDS": "4"}
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    cmd = _cmd(teacher, "--input", str(corpus), "--output", str(out), "--batch-size", "2")
    victim = subprocess.Popen(cmd, cwd=ROOT, env=full, stderr=subprocess.DEVNULL)
    part1 = out / "part-00001-of-00004"
    try:
        deadline = time.monotonic() + 120
        while not (part1 / "metadata.json").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        teacher.proc.send_signal(signal.SIGSTOP)
        while time.monotonic() < deadline:
            files = glob.glob(str(part1 / "*.arrow"))
            if files and os.path.getsize(files[0]) > 1024:
                break
            time.sleep(0.05)
        assert victim.poll() is None, "the shard finished before it could be killed"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        teacher.proc.send_signal(signal.SIGCONT)
    with RecordingReader(part1) as r:
        kept = len(r)
    assert 0 < kept < 120  # some rows recorded, not all
    assert _verify(out, capsys).returncode == 1  # missing parts, an unfinished one
    procs = [
        subprocess.Popen(
            _cmd(
                teacher,
                "--input",
                str(corpus),
                "--output",
                str(out),
                "--shard-index",
                str(i),
                "--num-shards",
                "4",
            ),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert f"{kept} were recorded already" in results[1][0]
    single = _in(teacher, capsys, "--input", str(corpus), "--output", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    assert "1 repeated an earlier row" in single.stdout

    verdict = _verify(out, capsys)
    assert verdict.returncode == 0, verdict.stderr
    assert "4 part(s), 480 rows" in verdict.stdout  # the repeat is once in each of 2 parts
    assert "1 sequences repeated across parts" in verdict.stdout
    sharded, one = _rows(out), _rows(tmp_path / "one")
    assert len(one) == 479
    del sharded[300]  # the repeat: recorded again by its own shard
    assert sharded == one
    want = [np.asarray(s, np.int64).tobytes() for i, s in enumerate(SEQS) if i != 300]
    assert [r[0] for r in one] == want  # input order

    # The same union to plain pyarrow and `datasets`, without this project.
    files = sorted(glob.glob(str(out / "part-*" / "*.arrow")))
    table = pa.concat_tables(pa.ipc.open_stream(f).read_all() for f in files)
    assert table.column("token_ids").to_pylist() == SEQS
    import datasets

    ds = datasets.load_dataset("arrow", data_files=files, split="train")
    assert ds["token_ids"] == SEQS


def test_a_cut_shard_file_is_sealed_on_rerun(
    teacher: ServerProcess, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer killed mid-batch leaves a cut file: the re-run keeps its complete
    batches (rewritten so plain readers read it) and records the rest."""
    out = tmp_path / "rec"
    shard_2 = ["--input", str(corpus), "--num-shards", "3", "--shard-index", "2"]
    first = _in(teacher, capsys, *shard_2, "--output", str(out))
    assert first.returncode == 0, first.stderr
    (shard,) = glob.glob(str(out / "part-00002-of-00003" / "*.arrow"))
    data = Path(shard).read_bytes()
    Path(shard).write_bytes(data[: len(data) * 2 // 3])  # cut inside a batch
    again = _in(teacher, capsys, *shard_2, "--output", str(out))
    assert again.returncode == 0, again.stderr
    assert "sealing" in again.stderr
    for f in glob.glob(str(out / "part-00002-of-00003" / "*.arrow")):
        pa.ipc.open_stream(f).read_all()  # every file reads with plain pyarrow
    with RecordingReader(out / "part-00002-of-00003") as r:
        assert len({r.key(i) for i in range(len(r))}) == len(r) == 160
        assert not r.skipped
    fresh = _in(teacher, capsys, *shard_2, "--output", str(tmp_path / "fresh"))
    assert fresh.returncode == 0, fresh.stderr
    part = "part-00002-of-00003"
    assert _rows(out / part) == _rows(tmp_path / "fresh" / part)


def test_bad_input_is_refused_by_name_and_nothing_recorded_is_lost(
    teacher: ServerProcess,
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "rec"
    base = _cmd(teacher, "--input", str(corpus), "--output", str(out))[3:]
    res = _Result([*base, "--shard-index", "4", "--num-shards", "4"], capsys)
    assert res.returncode != 0
    assert "--shard-index 4 is out of range for --num-shards 4" in res.stderr
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "7")
    res = _Result([*base, "--num-shards", "4"], capsys)
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    assert "$JOB_COMPLETION_INDEX 7 is out of range for --num-shards 4" in res.stderr
    assert not out.exists()

    assert _Result([*base, "--shard-index", "0", "--num-shards", "2"], capsys).returncode == 0
    before = _rows(out)
    res = _Result([*base, "--shard-index", "1", "--num-shards", "3"], capsys)
    assert res.returncode != 0
    assert "part-00000-of-00002 was written with --num-shards 2; this run has --num-shards 3" in (
        res.stderr
    )
    # A part of another count copied in: --verify names it.
    (out / "part-00001-of-00003").mkdir()
    res = _verify(out, capsys)
    assert res.returncode == 1
    assert "part-00001-of-00003: written with another shard count (3; the other parts have 2)" in (
        res.stderr
    )
    assert "part-00001-of-00002: missing" in res.stderr
    (out / "part-00001-of-00003").rmdir()
    assert _rows(out) == before

    # A corrupt row group in the input: the rows before it are recorded, the error names
    # the file and the row group; after a fix, the re-run resumes.
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": SEQS[:100]}), bad, row_group_size=20, compression="none")
    col = pq.ParquetFile(bad).metadata.row_group(3).column(0)
    data = bytearray(bad.read_bytes())
    data[col.data_page_offset : col.data_page_offset + col.total_compressed_size] = b"\xff" * (
        col.total_compressed_size
    )
    bad.write_bytes(bytes(data))
    rec2 = tmp_path / "rec2"
    res = _in(teacher, capsys, "--input", str(bad), "--output", str(rec2))
    assert res.returncode != 0
    assert f"{bad}: row group 3 is unreadable" in res.stderr
    assert "the rows before it are recorded" in res.stderr
    with RecordingReader(rec2) as r:
        assert len(r) == 60
    pq.write_table(pa.table({"input_ids": SEQS[:100]}), bad, row_group_size=20)
    res = _in(teacher, capsys, "--input", str(bad), "--output", str(rec2))
    assert res.returncode == 0, res.stderr
    assert "scored 40 sequences" in res.stdout and "60 were recorded already" in res.stdout

    # A damaged recording part: --verify names the shard file and the row.
    (shard,) = glob.glob(str(out / "part-00000-of-00002" / "*.arrow"))
    assert _Result([*base, "--shard-index", "1", "--num-shards", "2"], capsys).returncode == 0
    assert _verify(out, capsys).returncode == 0
    data = bytearray(Path(shard).read_bytes())
    data[-200] ^= 0x40
    Path(shard).write_bytes(bytes(data))
    res = _verify(out, capsys)
    assert res.returncode == 1
    assert os.path.basename(shard) in res.stderr


#: The recorder's stated memory bound for 8-sequence batches of 512 tokens at K = 16 with
#: the default --depth and --max-inflight: its peak RSS stays within this of a run that
#: records one batch (docs/datasets.md, "Recording a large corpus").
MEMORY_BOUND = 48 << 20
#: Prints the recorder's peak RSS (``VmHWM``, from /proc) as it exits.
_PEAK = (
    "import sys; from student_client.offline.record_cli import main; rc = main(sys.argv[1:]); "
    "print('peak', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]);"
    " sys.exit(rc)"
)


def test_a_corpus_ten_times_the_bound_records_within_it(
    teacher: ServerProcess, tmp_path: Path
) -> None:
    """A Parquet corpus of 487 MiB of int32 token ids (192 distinct 512-token rows, the
    rest repeats of them, so that the teacher scores 98,304 positions while the recorder
    reads, hashes and skips every row) records with peak RSS within MEMORY_BOUND of a
    one-batch recording's."""
    base = np.random.default_rng(5).integers(0, 512, (192, 512), dtype=np.int32)
    offsets = pa.array(np.arange(0, base.size + 1, 512, dtype=np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(base.ravel()))})
    reps = 1300
    with pq.ParquetWriter(tmp_path / "big.parquet", table.schema) as w:
        for _ in range(reps):
            w.write_table(table)
    pq.write_table(table.slice(0, 8), tmp_path / "tiny.parquet")
    corpus_bytes = reps * base.nbytes
    assert corpus_bytes >= 10 * MEMORY_BOUND

    def peak(name: str) -> tuple[int, str]:
        cmd = [sys.executable, "-c", _PEAK, *_cmd(teacher)[3:], "--top-k", "16"]
        cmd += ["--input", str(tmp_path / f"{name}.parquet"), "--output", str(tmp_path / name)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        return int(res.stdout.split("peak ")[-1].split()[0]) << 10, res.stdout

    one_batch, _ = peak("tiny")
    big, summary = peak("big")
    assert "scored 192 sequences (98304 positions" in summary
    assert f"{reps * 192 - 192} repeated an earlier row" in summary
    growth = big - one_batch
    print(f"peak RSS: one batch {one_batch >> 20} MiB, corpus {big >> 20} MiB, growth "
          f"{growth / 2**20:.1f} MiB for a {corpus_bytes >> 20} MiB corpus")  # fmt: skip
    assert growth < MEMORY_BOUND


def test_a_complete_part_run_again_keeps_its_record_and_metadata_numbers(
    teacher: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Re-running a finished recorder scores nothing and leaves ``part.json`` as the run
    that scored the part wrote it (not ``scored_positions: 0``); ``metadata.json`` keeps
    the teacher's 64-bit integers as JSON numbers."""
    corpus = tmp_path / "small.parquet"
    pq.write_table(pa.table({"input_ids": SEQS[:12]}), corpus, row_group_size=6)
    out = tmp_path / "rec"
    args = ("--input", str(corpus), "--output", str(out), "--num-shards", "2", "--shard-index")
    first = _in(teacher, capsys, *args, "0")
    assert first.returncode == 0, first.stderr
    (part,) = out.glob("part-00000-*")
    before = json.loads((part / "part.json").read_text())
    assert before["scored_positions"] == sum(len(s) for s in SEQS[:6])
    again = _in(teacher, capsys, *args, "0")
    assert again.returncode == 0, again.stderr
    assert "scored 0 sequences" in again.stdout and "6 were recorded already" in again.stdout
    assert json.loads((part / "part.json").read_text()) == before
    teacher_info = json.loads((part / "metadata.json").read_text())["teacher"]
    assert teacher_info["max_tokens_per_request"] == 262_144  # a number, not "262144"
