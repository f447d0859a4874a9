"""Recordings (Arrow IPC directories): round trip, flexible replay against the teacher's own
encoding, readers that do not import this project, a SIGKILLed writer, resume, and a
student-only environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from recording_fakes import INFO, K, assert_bit_equal, live_payload, teacher_answer

from student_client.data.assembler import ResponseAssembler
from student_client.offline.replay_client import ReplayClient
from topk_protocol import (
    SequenceArrays,
    build_request,
    encode_sequence,
    pb,
)
from topk_protocol.errors import NotRecordedError, RecordingError, VocabMismatchError
from topk_protocol.recording import (
    RecordingReader,
    RecordingWriter,
    RowSpan,
    cast_like_teacher,
    sequence_key,
)

ROOT = Path(__file__).resolve().parents[3]


def _record(
    path: Path, n: int, *, dtype: str = "float32", **kwargs: Any
) -> dict[bytes, SequenceArrays]:
    """Record n sequences (through ``write``, as the client does); returns the corpus."""
    corpus = {}
    with RecordingWriter(path, INFO, **kwargs) as w:
        for i in range(n):
            tokens, scored = teacher_answer(int(5 + 7 * i), seed=i)
            corpus[tokens.tobytes()] = scored
            live = live_payload({tokens.tobytes(): scored}, [tokens], K, dtype=dtype)
            req = build_request([tokens], K, dtype=dtype)
            asm = ResponseAssembler(req)
            asm.add(
                pb.ScoreResponse(
                    final=True,
                    sequences=[
                        encode_sequence(
                            SequenceArrays(
                                live.ids[0].numpy(),
                                live.logprobs[0].numpy(),
                                live.sampled_logprobs[0].numpy(),  # type: ignore[index]
                            ),
                            dtype=dtype,
                        )
                    ],
                )
            )
            assert w.write(req, asm.merged_response()) == 1
            assert w.write(req, asm.merged_response()) == 0  # already covered
    return corpus


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_and_metadata(tmp_path: Path, dtype: str) -> None:
    corpus = _record(tmp_path / "rec", 4, dtype=dtype)
    with RecordingReader(tmp_path / "rec") as r:
        assert (len(r), r.top_k, r.dtype, r.temperature, r.skipped) == (4, K, dtype, 1.0, [])
        assert r.info == INFO
        meta = json.loads((tmp_path / "rec" / "metadata.json").read_text())
        assert meta["vocab_size"] == 512 and meta["tokenizer_fingerprint"] == "ab" * 32
        for tokens, row in r:
            full = corpus[tokens.tobytes()]
            assert np.array_equal(row.ids, full.ids)
            assert row.logprobs.dtype == np.float32  # the dtype's values, widened exactly
            want = cast_like_teacher(full.logprobs, dtype).astype(np.float32)
            assert row.logprobs.tobytes() == want.tobytes()
            assert (row.position_start, row.position_end) == (0, len(full.ids))


def test_flexible_replay_is_byte_identical_to_theteacher_answer(tmp_path: Path) -> None:
    corpus = _record(tmp_path / "rec", 5)
    seqs = [np.frombuffer(t, "<i4") for t in corpus]
    with ReplayClient(tmp_path / "rec") as replay:
        cases: list[tuple[list[np.ndarray], int, dict[str, Any]]] = [
            ([seqs[3], seqs[0], seqs[4]], K, {"dtype": "float32"}),  # re-batched, shuffled
            ([seqs[2]], 3, {"dtype": "float16"}),  # sub-K, float32 -> float16
            ([seqs[4], seqs[1]], 8, {"dtype": "bfloat16", "positions": [(3, 20), (0, 1)]}),
            ([seqs[1], seqs[1]], 1, {"include_sampled": False, "positions": [(2, 2), (4, 12)]}),
        ]
        for batch, k, kwargs in cases:
            assert_bit_equal(
                live_payload(corpus, batch, k, **kwargs), replay.score(batch, k, **kwargs)
            )
        unknown = np.array([1, 2, 3], np.int32)
        with pytest.raises(
            NotRecordedError, match=r"sequences\[1\] \(3 tokens starting \[1, 2, 3\]\)"
        ):
            replay.score([seqs[0], unknown], 4)
        with pytest.raises(NotRecordedError, match="top_k: 17 is more than the recorded K 16"):
            replay.score([seqs[0]], 17)


def test_a_float16_recording_serves_only_float16(tmp_path: Path) -> None:
    corpus = _record(tmp_path / "rec", 2, dtype="float16")
    seqs = [np.frombuffer(t, "<i4") for t in corpus]
    with ReplayClient(tmp_path / "rec") as replay:
        p = replay.score(seqs[::-1], 5, dtype="float16")
        assert_bit_equal(live_payload(corpus, seqs[::-1], 5, dtype="float16"), p)
        for dtype in ("float32", "bfloat16"):
            with pytest.raises(
                NotRecordedError,
                match=f"dtype: the recording holds float16 log-probs, .* teacher's {dtype} values",
            ):
                replay.score(seqs, 5, dtype=dtype)


def test_copies_positions_and_sampled(tmp_path: Path) -> None:
    """A sequence recorded twice: [0, 10) without sampled log-probs, then [5, 30) with."""
    tokens, full = teacher_answer(30, seed=9)
    corpus = {tokens.tobytes(): full}
    with RecordingWriter(tmp_path / "rec", INFO, top_k=K, dtype="float32") as w:
        unsampled = replace(full, sampled_logprobs=None)
        assert w.add(tokens, unsampled.rows(0, 10), dtype="float32")
        assert not w.add(tokens, unsampled.rows(2, 8), dtype="float32")
        assert w.add(tokens, full.rows(5, 30), dtype="float32")
        assert w.index.rows_of(sequence_key(tokens)) == [
            RowSpan(0, 0, 10, False),
            RowSpan(1, 5, 30, True),
        ]
    with ReplayClient(tmp_path / "rec") as replay:
        for pos, sampled in (((0, 10), False), ((6, 30), True), ((5, 9), True)):
            kw: dict[str, Any] = {"positions": [pos], "include_sampled": sampled}
            assert_bit_equal(
                live_payload(corpus, [tokens], K, **kw), replay.score([tokens], K, **kw)
            )
        with pytest.raises(NotRecordedError, match="sampled log-probs are not recorded"):
            replay.score([tokens], K, positions=[(0, 4)])
        with pytest.raises(
            NotRecordedError,
            match=r"positions \[0, 30\) are not recorded \(recorded: \[0, 10\), \[5, 30\)\)",
        ):
            replay.score([tokens], K, positions=[(0, 30)], include_sampled=False)


def test_resume_appends_a_shard_and_checks_theteacher_answer(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    _record(path, 2)
    tokens, full = teacher_answer(12, seed=77)
    with RecordingWriter(path, INFO) as w:  # K and dtype come from metadata.json
        assert len(w) == 2 and (w.top_k, w.dtype) == (K, "float32")
        assert w.add(tokens, full, dtype="float32")
        with pytest.raises(RecordingError, match="top_k: 8 is less than the recorded 16"):
            w.add(tokens, full.top(8), dtype="float32")
        with pytest.raises(RecordingError, match="dtype: float16 log-probs cannot give"):
            w.add(tokens, full, dtype="float16")
        # One index: the resumed rows, then this session's, numbered as a reader sees them.
        spans = [w.index.rows_of(w.index.key(i)) for i in range(3)]
    assert len(list(path.glob("*.arrow"))) == 2
    with RecordingReader(path) as r:
        assert len(r) == 3
        assert [r.index.rows_of(r.key(i)) for i in range(3)] == spans
        assert spans[2] == [RowSpan(2, 0, 12, True)]
    other = pb.TeacherInfo()
    other.CopyFrom(INFO)
    other.vocab_size = 320
    with pytest.raises(RecordingError, match="vocab_size: recorded 512, this teacher has 320"):
        RecordingWriter(path, other)
    with pytest.raises(VocabMismatchError, match="vocab_size"):
        ReplayClient(path, expect_vocab_size=320)
    with pytest.raises(RecordingError, match=r"no metadata\.json"):
        RecordingReader(tmp_path)


_PLAIN_READER = textwrap.dedent(
    """
    import glob, json, sys
    import numpy as np, pyarrow as pa
    root = sys.argv[1]
    files = sorted(glob.glob(root + "/*.arrow"))
    table = pa.concat_tables(pa.ipc.open_stream(f).read_all() for f in files)
    k = json.load(open(root + "/metadata.json"))["top_k"]
    out = {"pyarrow": [], "datasets": []}
    for i in range(table.num_rows):
        row = table.slice(i, 1)
        ids = np.asarray(row.column("ids").combine_chunks().flatten().flatten()).reshape(-1, k)
        lps = np.asarray(row.column("logprobs").combine_chunks().flatten().flatten())
        out["pyarrow"].append([row.column("token_ids")[0].as_py(), ids.tolist(),
                               lps.astype(np.float32).reshape(-1, k).tolist()])
    import datasets
    ds = datasets.load_dataset("arrow", data_files=files, split="train").with_format("numpy")
    for i in range(len(ds)):
        r = ds[i]
        out["datasets"].append([r["token_ids"].tolist(), np.stack(r["ids"]).tolist(),
                                np.stack(r["logprobs"]).astype(np.float32).tolist()])
    ds2 = datasets.Dataset.from_file(files[0])
    assert len(ds2) > 0 and ds2.features["ids"] is not None
    assert "student_client" not in sys.modules and "teacher_server" not in sys.modules
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_plain_pyarrow_and_datasets_read_what_the_project_decodes(
    tmp_path: Path, compression: str
) -> None:
    path = tmp_path / "rec"
    _record(path, 3, dtype="float16", compression=compression)
    res = subprocess.run(
        [sys.executable, "-c", _PLAIN_READER, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    with RecordingReader(path) as r:
        mine = [[t.tolist(), row.ids.tolist(), row.logprobs.tolist()] for t, row in r]
    assert len(mine) == 3
    assert got["pyarrow"] == mine
    assert got["datasets"] == mine


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from topk_protocol.recording import RecordingWriter
    from topk_protocol import SequenceArrays, pb
    info = pb.TeacherInfo(model_name="fake", vocab_size=512, max_top_k=64, schema_version=1)
    w = RecordingWriter(sys.argv[1], info, top_k=4, dtype="float16", flush_interval_s=0.2)
    rng = np.random.default_rng(0)
    i = 0
    while True:
        n = 3 + i % 20
        tok = np.full(n, i % 512) + np.arange(n) * 0
        tok[0] = i // 512
        ids = np.tile(np.arange(4, dtype=np.int32), (n, 1)) + i % 100
        lps = -np.sort(rng.exponential(2.0, (n, 4)).astype(np.float32), axis=1)
        w.add(tok, SequenceArrays(ids, lps, lps[:, 0]), dtype="float32")
        # row i is added (it reaches the file at the next flush); rows_written are on disk
        print(i, w.rows_written, flush=True)
        i += 1
        time.sleep(0.002)
    """
)


def test_a_sigkilled_writer_loses_at_most_the_last_flush_interval(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    added = flushed = 0
    t0 = time.monotonic()
    while added < 600 and time.monotonic() - t0 < 120:
        line = proc.stdout.readline()
        if not line:
            break
        added, flushed = int(line.split()[0]) + 1, int(line.split()[1])
    time.sleep(0.37)  # mid-interval: some rows flushed, some only in memory
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    rest = [line.split() for line in proc.stdout]
    added_before_kill = added + len(rest)
    flushed = max([flushed] + [int(f) for _, f in rest])  # flushed before the kill, at least
    rng = np.random.default_rng(0)
    with RecordingReader(path) as r:
        n = len(r)
        assert 0 < flushed <= n <= added_before_kill
        # Every kept row is byte-identical to what was written, in order.
        for i, (tokens, row) in enumerate(r):
            m = 3 + i % 20
            lps = -np.sort(rng.exponential(2.0, (m, 4)).astype(np.float32), axis=1)
            f16 = lps.astype(np.float16).astype(np.float32)  # stored float16, read widened
            assert row.logprobs.tobytes() == f16.tobytes()
            assert row.sampled_logprobs is not None
            assert row.sampled_logprobs.tobytes() == f16[:, 0].tobytes()
            assert row.ids.tolist() == (np.tile(np.arange(4), (m, 1)) + i % 100).tolist()
            assert tokens[0] == i // 512
        print(f"kept {n} of {added_before_kill} rows added ({flushed} known flushed); {r.skipped}")
    # Rows added more than a flush interval (0.2 s) before the kill were flushed: the
    # writer added about one row per 2-3 ms, so at most ~0.6 s of rows may be missing.
    assert added_before_kill - n < 400


def test_truncated_last_batch_is_skipped_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    _record(path, 3, compression="none", flush_interval_s=1000)
    with RecordingWriter(path, INFO, flush_interval_s=1000) as w:
        for i in range(2):
            tokens, full = teacher_answer(40, seed=100 + i)
            w.add(tokens, replace(full, sampled_logprobs=None), dtype="float32")
            w.flush()
    shard = sorted(path.glob("*.arrow"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 8 - 300])  # cut the end-of-stream and the last batch
    with pytest.warns(UserWarning, match=r"kept 1 complete batches; skipped the \d+ bytes"):
        r = RecordingReader(path)
    with r:
        assert len(r) == 4 and len(r.skipped) == 1 and shard.name in r.skipped[0]


def test_key_is_the_token_ids_only() -> None:
    a = np.array([1, 2, 3])
    assert sequence_key(a) == sequence_key(a.astype("<i4").tobytes()) == sequence_key([1, 2, 3])
    assert sequence_key(a) != sequence_key(np.array([1, 2, 3, 0]))
    assert len(sequence_key(a)) == 32


_STUDENT_ONLY = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("zstandard", "vllm", "transformers", "datasets",
                                      "teacher_server", "fastapi"):
                raise ImportError(f"{name} is not installed (student-only)")
    sys.meta_path.insert(0, Block())
    import numpy as np
    from topk_protocol.recording import RecordingWriter
    from student_client.offline.replay_client import ReplayClient
    from topk_protocol import SequenceArrays, pb
    info = pb.TeacherInfo(model_name="m", vocab_size=512, max_top_k=64, schema_version=1)
    rng = np.random.default_rng(0)
    with RecordingWriter(sys.argv[1], info, top_k=8, dtype="float32") as w:
        ids = np.argsort(rng.random((9, 512)), 1)[:, :8]
        lps = -np.sort(rng.exponential(2, (9, 8)).astype(np.float32), 1)
        w.add(np.arange(9), SequenceArrays(ids, lps), dtype="float32")
    with ReplayClient(sys.argv[1]) as c:
        p = c.score([np.arange(9)], 4, dtype="bfloat16", include_sampled=False)
    print(tuple(p.ids.shape), p.dtype)
    """
)


def test_student_only_environment_records_and_replays(tmp_path: Path) -> None:
    """zstd comes from pyarrow: no zstandard, server or engine package is imported."""
    res = subprocess.run(
        [sys.executable, "-c", _STUDENT_ONLY, str(tmp_path / "rec")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["(1,", "9,", "4)", "bfloat16"]
