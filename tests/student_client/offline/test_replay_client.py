"""Replay against the live vLLM teacher. A recording of this run's live engine (the
requests of ``scripts/record_fixture.py``, K = 64 float32, recorded into a temporary
directory) answers re-batched, shuffled, sub-K, sub-range and dtype-converted requests
byte-identically to the same live engine, through ``ReplayClient`` and through
``teacher-server --backend replay``: bit for bit, because both answers come from one
engine on one machine. The committed recording (``tests/data/tiny_vllm_recording/``, made
the same way on some other machine) describes the live teacher and matches its answers
within float32 drift: another CPU computes the same sums with other kernels.
``teacher-record`` builds a dataset from the live teacher, resumes, and its
``PayloadDataset`` batches equal the live answers."""

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
from engine_drift import FLOAT32_DRIFT, assert_same_topk
from recording_fakes import assert_bit_equal

from scripts import record_fixture
from student_client.clients.blocking import TeacherClient
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay_client import ReplayClient
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingReader

FIXTURE = ROOT / "tests" / "data" / "tiny_vllm_recording"

pytestmark = pytest.mark.vllm


def _rows(recording: Path) -> list[tuple[np.ndarray, int, int, bool]]:
    """Each recorded row: (token ids, start, end, with sampled log-probs)."""
    with RecordingReader(recording) as r:
        return [
            (t.copy(), row.position_start, row.position_end, row.sampled_logprobs is not None)
            for t, row in r
        ]


@pytest.fixture(scope="module")
def live_recording(vllm_teacher: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed fixture's requests (``scripts/record_fixture.py``), recorded now from
    this run's live engine."""
    out = tmp_path_factory.mktemp("live") / "recording"
    with TeacherClient(vllm_teacher.target, record_to=out) as client:
        record_fixture.record(client)
    return out


@pytest.fixture(scope="module")
def replay_server(
    live_recording: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("replay") / "server.log"
    server = start_server(["--backend", "replay", "--recording", str(live_recording)], log)
    yield server
    server.stop()


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "live"])
def test_recording_describes_the_live_teacher(
    vllm_teacher: ServerProcess, live_recording: Path, committed: bool
) -> None:
    recording = FIXTURE if committed else live_recording
    assert sum(p.stat().st_size for p in recording.iterdir()) < 1_000_000
    with RecordingReader(recording) as r:
        assert (len(r), r.top_k, r.dtype, r.skipped) == (8, 64, "float32", [])
        recorded = r.info
    with TeacherClient(vllm_teacher.target) as client:
        live = client.info()
    assert recorded.backend == live.backend == "vllm"
    assert recorded.vocab_size == live.vocab_size == 512
    assert recorded.tokenizer_fingerprint == live.tokenizer_fingerprint
    rows = [sorted((r[0].tobytes(), *r[1:]) for r in _rows(p)) for p in (recording, FIXTURE)]
    assert rows[0] == rows[1]  # the same sequences, ranges and sampled log-probs


def test_committed_fixture_matches_the_live_teacher_within_float32_drift(
    vllm_teacher: ServerProcess,
) -> None:
    """Every committed row, replayed, against this run's live engine: log-probs within
    ``FLOAT32_DRIFT`` (another CPU may sum in another order: the bound that vLLM holds
    against the transformers forward pass, another order altogether), ids where the rank
    is unambiguous at that drift (the live answer asked at K + 1 judges the last column)."""
    with TeacherClient(vllm_teacher.target) as live, ReplayClient(FIXTURE) as replay:
        for tokens, start, end, sampled in _rows(FIXTURE):
            kwargs: dict[str, Any] = {"positions": [(start, end)], "include_sampled": sampled}
            got = replay.score([tokens], 64, dtype="float32", **kwargs)
            want = live.score([tokens], 65, dtype="float32", **kwargs)
            n = end - start
            assert int(got.lengths[0]) == int(want.lengths[0]) == n
            assert int(got.position_start[0]) == int(want.position_start[0]) == start
            assert_same_topk(
                got.ids[0, :n].numpy(),
                got.logprobs[0, :n].numpy(),
                want.ids[0, :n].numpy(),
                want.logprobs[0, :n].numpy(),
                FLOAT32_DRIFT,
            )
            if sampled:
                assert got.sampled_logprobs is not None and want.sampled_logprobs is not None
                np.testing.assert_allclose(
                    got.sampled_logprobs[0, :n].numpy(),
                    want.sampled_logprobs[0, :n].numpy(),
                    atol=FLOAT32_DRIFT,
                    rtol=0,
                    equal_nan=True,
                )
            else:
                assert got.sampled_logprobs is None and want.sampled_logprobs is None


def _requests(recording: Path) -> list[tuple[list[np.ndarray], int, dict[str, Any]]]:
    """Requests the recording never saw as such: other batches, orders, K, ranges, dtypes."""
    rows = _rows(recording)
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
    vllm_teacher: ServerProcess, live_recording: Path, replay_server: ServerProcess
) -> None:
    """This run's recording replays bit for bit what this run's engine answers."""
    with (
        TeacherClient(vllm_teacher.target) as live,
        TeacherClient(replay_server.target) as served,
        ReplayClient(live_recording) as replay,
    ):
        assert served.info().backend == "replay"
        for seqs, k, kwargs in _requests(live_recording):
            want = live.score(seqs, k, **kwargs)
            assert_bit_equal(want, replay.score(seqs, k, **kwargs))
            assert_bit_equal(want, served.score(seqs, k, **kwargs))
        rows = _rows(live_recording)
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
