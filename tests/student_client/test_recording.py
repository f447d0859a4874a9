"""The recording file format: round trip, keys, index vs scan, random access, and the
errors on truncated or corrupted files (naming the file and the byte offset)."""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from student_client.errors import (
    InvalidRequestError,
    NotRecordedError,
    RecordingError,
    VocabMismatchError,
)
from student_client.payload import ResponseAssembler, build_request
from student_client.recording import RecordingReader, RecordingWriter, request_key
from student_client.replay import ReplayClient
from student_client.wire import pb
from teacher_server.backends.base import ScoredSequence
from teacher_server.payloads import iter_stream_responses

INFO = pb.TeacherInfo(
    model_name="fake",
    vocab_size=512,
    max_top_k=64,
    tokenizer_fingerprint="ab" * 32,
    schema_version=1,
    backend="test",
)


def _exchange(
    seed: int, k: int = 4, dtype: str = "float16"
) -> tuple[pb.ScoreRequest, pb.ScoreResponse]:
    """A request of 2 random sequences and a complete answer to it."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 512, size=n).tolist() for n in (int(rng.integers(2, 30)), 3)]
    req = build_request(seqs, k, dtype=dtype, request_id=f"id-{seed}")
    scored = []
    for s in seqs:
        n = len(s)
        ids = np.argsort(rng.random((n, 512)), axis=1)[:, :k].astype(np.int32)
        lps = -np.sort(rng.exponential(2.0, (n, k)).astype(np.float32), axis=1)
        sampled = -rng.exponential(2.0, n).astype(np.float32)
        sampled[-1] = np.nan
        scored.append(ScoredSequence(ids, lps, sampled, 0))
    asm = ResponseAssembler(req)
    for msg in iter_stream_responses(
        req.request_id, scored, top_k=k, dtype=req.dtype, include_sampled=True, chunk_bytes=100
    ):
        asm.add(msg)
    return req, asm.merged_response()


def _write(path: Path, n: int, *, compression: str = "zstd", close: bool = True) -> list:
    pairs = [_exchange(i) for i in range(n)]
    w = RecordingWriter(path, INFO, compression=compression, metadata={"note": "unit"})
    for req, resp in pairs:
        assert w.write(req, resp)
    if close:
        w.close()
    return pairs


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_round_trip_through_the_index(tmp_path: Path, compression: str) -> None:
    path = tmp_path / "r.tkrec"
    pairs = _write(path, 6, compression=compression)
    with RecordingReader(path) as r:
        assert r.index_source == "index"
        assert len(r) == 6
        assert r.info == INFO
        assert r.metadata["note"] == "unit" and r.metadata["compression"] == compression
        for req, resp in reversed(pairs):  # any order: random access
            got_req, got_resp = r.get(request_key(req))  # type: ignore[misc]
            assert got_req == req and got_resp == resp
        assert [q for q, _ in r] == [q for q, _ in pairs]


def test_zstd_makes_it_smaller(tmp_path: Path) -> None:
    _write(tmp_path / "z.tkrec", 6, compression="zstd")
    _write(tmp_path / "n.tkrec", 6, compression="none")
    assert (tmp_path / "z.tkrec").stat().st_size < (tmp_path / "n.tkrec").stat().st_size


def test_key_ignores_request_id_and_normalizes_positions() -> None:
    a = build_request([[1, 2, 3], [4]], 4, request_id="a")
    b = build_request([[1, 2, 3], [4]], 4, request_id="b", positions=[(0, 3), (0, 1)])
    assert request_key(a) == request_key(b)
    different = [
        build_request([[1, 2, 3], [4]], 5),
        build_request([[1, 2, 3], [4]], 4, dtype="float32"),
        build_request([[1, 2, 3], [4]], 4, include_sampled=False),
        build_request([[1, 2, 3], [4]], 4, positions=[(1, 3), (0, 1)]),
        build_request([[1, 2, 3], [5]], 4),
        build_request([[1, 2], [3, 4]], 4),  # same bytes, other split
    ]
    keys = {request_key(r) for r in different} | {request_key(a)}
    assert len(keys) == len(different) + 1


def test_duplicate_request_is_written_once(tmp_path: Path) -> None:
    req, resp = _exchange(0)
    with RecordingWriter(tmp_path / "d.tkrec", INFO) as w:
        assert w.write(req, resp)
        again = pb.ScoreRequest()
        again.CopyFrom(req)
        again.request_id = "other"
        assert not w.write(again, resp)
        assert len(w) == 1


def test_missing_index_is_rebuilt_by_scanning_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "open.tkrec"
    pairs = _write(path, 4, close=False)  # the writer never closed: no index, no footer
    with pytest.warns(UserWarning, match="no index at the end"), RecordingReader(path) as r:
        assert r.index_source == "scan"
        assert len(r) == 4
        assert r.get(request_key(pairs[2][0]))[1] == pairs[2][1]  # type: ignore[index]


def test_lookups_use_the_index_not_a_scan(tmp_path: Path) -> None:
    """Corrupt one record: every other one is still served (a scan would stop there),
    and reading the corrupt one names its offset."""
    path = tmp_path / "c.tkrec"
    pairs = _write(path, 5, compression="none")
    with RecordingReader(path) as r:
        offsets = r.offsets()
    data = bytearray(path.read_bytes())
    data[offsets[2] + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    with RecordingReader(path) as r:
        for i in (0, 1, 3, 4):
            assert r.get(request_key(pairs[i][0]))[1] == pairs[i][1]  # type: ignore[index]
        with pytest.raises(RecordingError) as e:
            r.get(request_key(pairs[2][0]))
    assert e.value.offset == offsets[2]
    assert str(path) in str(e.value) and f"byte offset {offsets[2]}" in str(e.value)
    assert "CRC32" in str(e.value)


def test_truncated_file_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "t.tkrec"
    _write(path, 4)
    with RecordingReader(path) as r:
        offsets = r.offsets()
    data = path.read_bytes()
    path.write_bytes(data[: offsets[3] + 20])  # cut inside the last record
    with pytest.raises(RecordingError) as e:
        RecordingReader(path)
    assert e.value.offset == offsets[3] and "truncated" in str(e.value)
    assert str(path) in str(e.value)
    # Not strict: the complete records are kept, with warnings.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RecordingReader(path, strict=False) as r:
            assert len(r) == 3
    assert any("truncated" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("mutate", "offset", "message"),
    [
        (lambda d: b"NOTAREC!" + d[8:], 0, "not a topk-distill recording"),
        (lambda d: d[:10], 0, "truncated header"),
        (lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], 20, "header CRC32"),
        (lambda d: d[:-24] + bytes([d[-24] ^ 1]) + d[-23:], -24, "footer CRC32"),
        (lambda d: d[:-24] + struct.pack("<QI", 10, 0) + d[-12:], -24, "footer"),
    ],
)
def test_corrupted_file_is_refused(
    tmp_path: Path, mutate: Callable[[bytes], bytes], offset: int, message: str
) -> None:
    path = tmp_path / "x.tkrec"
    _write(path, 3)
    data = mutate(path.read_bytes())
    path.write_bytes(data)
    with pytest.raises(RecordingError, match=message) as e:
        RecordingReader(path)
    assert e.value.offset == (offset if offset >= 0 else len(data) + offset)
    assert str(path) in str(e.value)


def test_replay_client_answers_recorded_requests_bit_exactly(tmp_path: Path) -> None:
    path = tmp_path / "rc.tkrec"
    pairs = _write(path, 3)
    with ReplayClient(path, expect_vocab_size=512) as client:
        assert client.info().model_name == "fake" and len(client) == 3
        for req, resp in pairs:
            seqs = [np.frombuffer(s.token_ids, "<i4") for s in req.sequences]
            got = client.score(seqs, req.top_k, dtype="float16")
            asm = ResponseAssembler(req)
            asm.add(resp)
            want = asm.payload()
            assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
            assert torch.equal(got.sampled_logprobs.isnan(), want.sampled_logprobs.isnan())  # type: ignore[union-attr]
        streamed = list(
            client.stream(
                [[np.frombuffer(s.token_ids, "<i4") for s in q.sequences] for q, _ in pairs], 4
            )
        )
        assert len(streamed) == 3
        with pytest.raises(NotRecordedError, match=r"request not recorded: 2 sequences .* top_k 5"):
            client.score(seqs, 5)
        with pytest.raises(InvalidRequestError, match="top_k: 65 is outside"):
            client.score(seqs, 65)
        with pytest.raises(InvalidRequestError, match=r"token_ids\[1\]: 600 is outside"):
            client.score([[1, 600]], 4)


def test_replay_client_checks_the_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "v.tkrec"
    _write(path, 1)
    with pytest.raises(
        VocabMismatchError, match="vocab_size: the teacher has 512, the student expects 320"
    ):
        ReplayClient(path, expect_vocab_size=320)
    with pytest.raises(VocabMismatchError, match="tokenizer_fingerprint"):
        ReplayClient(path, expect_tokenizer_fingerprint="00")
