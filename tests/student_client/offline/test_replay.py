"""Replay against the live vLLM teacher. The committed recording
(``tests/data/tiny_vllm_recording/``, K = 64 float32, made by ``scripts/record_fixture.py``
in another engine run) answers re-batched, shuffled, sub-K, sub-range and dtype-converted
requests byte-identically to this run's live engine, through ``ReplayClient`` and through
``teacher-server --backend replay``; ``teacher-record`` builds a dataset from the live
teacher, resumes, and its ``PayloadDataset`` batches equal the live answers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, ServerProcess, start_server
from recording_fakes import assert_bit_equal

from student_client.clients.blocking import TeacherClient
from student_client.errors import NotRecordedError
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay import ReplayClient
from topk_protocol.recording import RecordingReader

FIXTURE = ROOT / "tests" / "data" / "tiny_vllm_recording"

pytestmark = pytest.mark.vllm


def _fixture_rows() -> list[tuple[np.ndarray, int, int, bool]]:
    with RecordingReader(FIXTURE) as r:
        return [
            (t.copy(), row.position_start, row.position_end, row.sampled_logprobs is not None)
            for t, row in r
        ]


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("replay") / "server.log"
    server = start_server(["--backend", "replay", "--recording", str(FIXTURE)], log)
    yield server
    server.stop()


def test_fixture_describes_the_live_teacher(vllm_teacher: ServerProcess) -> None:
    assert sum(p.stat().st_size for p in FIXTURE.iterdir()) < 1_000_000
    with RecordingReader(FIXTURE) as r:
        assert (len(r), r.top_k, r.dtype, r.skipped) == (8, 64, "float32", [])
        recorded = r.info
    with TeacherClient(vllm_teacher.target) as client:
        live = client.info()
    assert recorded.backend == live.backend == "vllm"
    assert recorded.vocab_size == live.vocab_size == 512
    assert recorded.tokenizer_fingerprint == live.tokenizer_fingerprint


def _requests() -> list[tuple[list[np.ndarray], int, dict[str, Any]]]:
    """Requests the fixture never saw as such: other batches, orders, K, ranges, dtypes."""
    rows = _fixture_rows()
    full = [r for r in rows if r[1] == 0 and r[3]]  # every position, with sampled
    part = next(r for r in rows if r[1] > 0)  # a recorded sub-range
    bare = next(r for r in rows if not r[3])  # recorded without sampled log-probs
    toks = [r[0] for r in full]
    return [
        (toks[::-1], 64, {"dtype": "float32"}),
        ([toks[2], toks[0]], 8, {"dtype": "float16"}),
        ([toks[1]], 1, {"dtype": "bfloat16"}),
        (
            [toks[3], part[0], toks[0]],
            20,
            {"dtype": "bfloat16", "positions": [(2, 9), (part[1] + 3, part[2]), (5, 5)]},
        ),
        ([bare[0], toks[4]], 33, {"dtype": "float16", "include_sampled": False}),
    ]


def test_replay_is_byte_identical_to_the_live_teacher(
    vllm_teacher: ServerProcess, replay_server: ServerProcess
) -> None:
    with (
        TeacherClient(vllm_teacher.target) as live,
        TeacherClient(replay_server.target) as served,
        ReplayClient(FIXTURE) as replay,
    ):
        assert served.info().backend == "replay"
        for seqs, k, kwargs in _requests():
            want = live.score(seqs, k, **kwargs)
            assert_bit_equal(want, replay.score(seqs, k, **kwargs))
            assert_bit_equal(want, served.score(seqs, k, **kwargs))
        rows = _fixture_rows()
        part = next(r for r in rows if r[1] > 0)
        bare = next(r for r in rows if not r[3])
        with pytest.raises(NotRecordedError, match=r"positions \[0, \d+\) are not recorded"):
            replay.score([part[0]], 8)
        with pytest.raises(NotRecordedError, match="sampled log-probs are not recorded"):
            served.score([bare[0]], 8)
        with pytest.raises(NotRecordedError, match="top_k: 65 is more than the recorded K"):
            replay.score([rows[0][0]], 65)


def test_teacher_record_builds_a_resumable_dataset(
    vllm_teacher: ServerProcess, tmp_path: Path
) -> None:
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 512, size=int(n)).tolist() for n in rng.integers(5, 120, size=10)]
    (tmp_path / "tokens.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seqs[:6]))
    pq.write_table(pa.table({"input_ids": seqs}), tmp_path / "tokens.parquet")
    out = tmp_path / "scored"

    def record(source: str) -> str:
        cmd = [
            sys.executable,
            "-m",
            "student_client.offline.record_cli",
            "--teacher",
            vllm_teacher.target,
        ]
        cmd += ["--input", str(tmp_path / source), "--output", str(out), "--top-k", "16"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert "scored 6 sequences" in record("tokens.jsonl")
    assert "scored 4 sequences" in record("tokens.parquet")  # resumed: 6 already there
    assert "scored 0 sequences" in record("tokens.parquet")
    ds = PayloadDataset(out, top_k=8, include_sampled=True)
    assert (len(ds), ds.reader.top_k, ds.reader.dtype) == (10, 16, "float16")
    order = [9, 3, 0, 6]
    batch = collate_payloads([ds[i] for i in order])
    with TeacherClient(vllm_teacher.target) as live:
        want = live.score([seqs[i] for i in order], 8, dtype="float16")
    assert_bit_equal(want, batch.payload)
