"""Recordings on object storage, against a real S3-compatible server (moto's server mode
on loopback, started by the tests): the same bytes as a local recording, resume, a
SIGKILLed writer, and an unreachable bucket or endpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from object_store import closed_port, make_bucket, moto_server
from recording_fakes import INFO, K

from topk_protocol import SequenceArrays
from topk_protocol.errors import RecordingError
from topk_protocol.recording import (
    DEFAULT_FLUSH_BYTES,
    DEFAULT_OBJECT_FLUSH_BYTES,
    METADATA_FILE,
    RecordingReader,
    RecordingWriter,
)
from topk_protocol.storage import Location

ROOT = Path(__file__).resolve().parents[3]


def answer(i: int) -> tuple[np.ndarray, SequenceArrays]:
    """Sequence ``i``: ``3 + 7 i % 47`` tokens and a float32 answer for all positions."""
    rng = np.random.default_rng(i)
    n = 3 + (7 * i) % 47
    tokens = rng.integers(0, INFO.vocab_size, n).astype(np.int32)
    ids = rng.integers(0, INFO.vocab_size, (n, K)).astype(np.int32)
    lps = -np.sort(rng.exponential(2.0, (n, K)).astype(np.float32), axis=1)
    return tokens, SequenceArrays(ids, lps, None, 0)


def record(path: str | Path, rows: range, **kwargs: Any) -> None:
    with RecordingWriter(path, INFO, flush_interval_s=3600, **kwargs) as w:
        for i in rows:
            w.add(*answer(i), dtype="float32")


def files(loc: Location) -> dict[str, bytes]:
    """Every file of a recording directory: ``metadata.json`` (without its creation time)
    and the shards, in row order, by position."""
    meta = json.loads(loc.child(METADATA_FILE).read_bytes())
    del meta["created_unix"]
    out = {METADATA_FILE: json.dumps(meta, sort_keys=True).encode()}
    from topk_protocol.recording.format import shards

    for n, (shard, _) in enumerate(shards(loc)):
        out[f"shard {n}"] = shard.read_bytes()
    return out


def rows(path: str | Path) -> list[tuple[bytes, bytes, bytes]]:
    with RecordingReader(path) as r:
        assert r.skipped == [] and r.verify() == []
        return [(t.tobytes(), a.ids.tobytes(), a.logprobs.tobytes()) for t, a in r]


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_an_s3_recording_is_the_local_one_byte_for_byte(
    s3_bucket: str, tmp_path: Path, compression: str
) -> None:
    uri = f"{s3_bucket}/runs/scored"
    record(tmp_path / "local", range(23), compression=compression)
    record(uri, range(23), compression=compression)
    local, remote = files(Location.of(tmp_path / "local")), files(Location.of(uri))
    assert local.keys() == remote.keys() == {METADATA_FILE, "shard 0"}
    assert local == remote
    assert rows(uri) == rows(tmp_path / "local") and len(rows(uri)) == 23
    # plain pyarrow reads the objects through its own filesystem, without this project
    fs, path = pafs.FileSystem.from_uri(uri)
    (shard,) = [i.path for i in fs.get_file_info(pafs.FileSelector(path)) if i.extension == "arrow"]
    with fs.open_input_stream(shard) as f:
        assert pa.ipc.open_stream(f).read_all().num_rows == 23


def test_an_s3_recording_resumes_and_each_flush_commits_one_object(s3_bucket: str) -> None:
    uri = f"{s3_bucket}/rec"
    record(uri, range(10))
    with RecordingWriter(uri, INFO, flush_interval_s=3600) as w:
        assert len(w) == 10
        assert [w.add(*answer(i), dtype="float32") for i in (3, 10, 11)] == [False, True, True]
        w.flush()  # one object
        w.add(*answer(12), dtype="float32")  # the next object, committed by close
    loc = Location.of(uri)
    from topk_protocol.recording.format import shards

    assert [s.name.split("-")[1] for s, _ in shards(loc)] == ["00000", "00001", "00002"]
    assert rows(uri) == [(t.tobytes(), a.ids.tobytes(), a.logprobs.tobytes()) for t, a in
                         (answer(i) for i in [*range(10), 10, 11, 12])]  # fmt: skip


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}, {tests!r}, {here!r}]
    from topk_protocol.recording import RecordingWriter
    from test_recording_storage import INFO, answer
    w = RecordingWriter({uri!r}, INFO, flush_interval_s=0.05)
    for i in range(10**6):
        w.add(*answer(i), dtype="float32")
        if i % 7 == 0:
            print(w.rows_written, flush=True)
    """
)


def test_a_writer_killed_mid_upload_leaves_only_whole_objects_and_resumes(s3_bucket: str) -> None:
    uri = f"{s3_bucket}/killed"
    code = _KILLED_WRITER.format(
        root=str(ROOT), tests=str(ROOT / "tests"), here=str(Path(__file__).parent), uri=uri
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    committed = set()  # rows_written after each commit seen: one object each
    for line in proc.stdout:  # wait for a few committed objects, then kill mid-write
        committed.add(int(line))
        if len(committed - {0}) >= 3 and int(line) >= 60:
            break
    assert proc.poll() is None, "the writer died before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with RecordingReader(uri) as r:
        n = len(r)
        assert r.skipped == [] and r.damaged == [] and r.verify() == []
        assert n >= 60
        shards_seen = len({c.name for c in (s.shard for s in r._slots)})
    assert shards_seen > 1
    assert rows(uri) == [(t.tobytes(), a.ids.tobytes(), a.logprobs.tobytes()) for t, a in
                         map(answer, range(n))]  # fmt: skip
    record(uri, range(n + 40))  # resume: only the rows not committed are written
    got = rows(uri)
    assert len(got) == n + 40 and len(set(got)) == n + 40


def test_an_unreachable_endpoint_fails_fast_naming_the_uri(s3_endpoint: str) -> None:
    uri = f"s3://bkt/rec?endpoint_override=127.0.0.1:{closed_port()}&scheme=http"
    for open_it in (lambda: RecordingWriter(uri, INFO), lambda: RecordingReader(uri)):
        t0 = time.monotonic()
        with pytest.raises(RecordingError, match="s3://bkt/rec") as err:
            open_it()
        assert time.monotonic() - t0 < 30, "no multi-minute retry hang"
        assert "connect" in str(err.value).lower()


def test_a_missing_bucket_fails_naming_it(s3_endpoint: str) -> None:
    with pytest.raises(RecordingError, match="bucket 'no-such-bucket' does not exist"):
        RecordingWriter("s3://no-such-bucket/rec", INFO)
    with pytest.raises(RecordingError, match=r"no-such-bucket.*no metadata\.json"):
        RecordingReader("s3://no-such-bucket/rec")


def test_rows_written_while_the_store_is_down_are_kept_and_written_when_it_returns() -> None:
    with moto_server() as endpoint:
        port = int(endpoint.rsplit(":", 1)[1])
        uri = f"{make_bucket()}/rec"
        w = RecordingWriter(uri, INFO, flush_interval_s=3600)
        for i in range(5):
            w.add(*answer(i), dtype="float32")
        w.flush()
    # the server is down: the flush fails, naming the shard, and keeps its rows
    for i in range(5, 9):
        w.add(*answer(i), dtype="float32")
    with pytest.raises(RecordingError, match=r"writing 4 rows failed \(kept to retry\)"):
        w.flush()
    assert w.rows_written == 5
    with moto_server(port):  # back (moto keeps its objects in this process)
        w.close()
        assert w.rows_written == 9
        assert len(rows(uri)) == 9


def test_replay_answers_from_an_s3_recording_as_from_the_local_one(
    s3_bucket: str, tmp_path: Path
) -> None:
    import asyncio

    from student_client.offline.replay_client import ReplayClient
    from teacher_server.backends.replay_backend import ReplayBackend, replay_path

    uri = f"{s3_bucket}/replayed"
    record(uri, range(9))
    record(tmp_path / "local", range(9))
    seqs = [answer(i)[0] for i in (4, 0, 8)]
    with ReplayClient(uri) as remote, ReplayClient(tmp_path / "local") as local:
        assert remote.path == uri
        kw: dict[str, Any] = {"dtype": "float16", "include_sampled": False}
        a, b = remote.score(seqs, 5, **kw), local.score(seqs, 5, **kw)
        assert a.ids.equal(b.ids) and a.logprobs.equal(b.logprobs) and a.mask.equal(b.mask)
    backend = ReplayBackend(replay_path(uri, None))
    asyncio.run(backend.start())
    assert len(backend.reader) == 9 and backend.info.vocab_size == INFO.vocab_size
    asyncio.run(backend.close())


def test_a_new_shard_follows_the_largest_number_in_use(tmp_path: Path) -> None:
    from topk_protocol.recording.format import next_shard_number, shards

    loc = Location.of(tmp_path)
    assert next_shard_number(shards(loc)) == 0
    for name in ("shard-00000-aa.arrow", "shard-00003-bb.arrow", "shard-100000-cc.arrow"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "shard-99999-dd.arrow").write_bytes(b"x")
    # a failed upload's number (1, 2) is not reused; 100000 sorts after 99999
    assert [s.name.split("-")[1] for s, _ in shards(loc)] == ["00000", "00003", "99999", "100000"]
    assert next_shard_number(shards(loc)) == 100001


def _row_bytes(i: int) -> int:
    """What sequence ``i`` holds in a float32 writer's buffer: its token ids and values."""
    tokens, arrays = answer(i)
    return tokens.nbytes + arrays.ids.nbytes + arrays.logprobs.nbytes


def test_a_writer_flushes_as_soon_as_flush_bytes_are_buffered(tmp_path: Path) -> None:
    """The flush is due when the buffered rows reach ``flush_bytes``, long before the
    interval: the rows are written as one record batch while the writer stays open."""
    path = tmp_path / "rec"
    limit = sum(_row_bytes(i) for i in range(3))
    with RecordingWriter(path, INFO, flush_interval_s=3600, flush_bytes=limit) as w:
        for i in range(2):
            w.add(*answer(i), dtype="float32")
        assert w.rows_written == 0  # below the limit: buffered
        w.add(*answer(2), dtype="float32")
        deadline = time.monotonic() + 60  # the flush thread's turn, not a timing bound
        while w.rows_written < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.rows_written == 3
        assert rows(path) == rows_of(range(3))  # readable while the writer is open
        w.add(*answer(3), dtype="float32")
        assert w.rows_written == 3
    assert rows(path) == rows_of(range(4))


def rows_of(ids: range) -> list[tuple[bytes, bytes, bytes]]:
    return [(t.tobytes(), a.ids.tobytes(), a.logprobs.tobytes()) for t, a in map(answer, ids)]


def test_flush_bytes_defaults_to_a_small_batch_locally_and_a_large_object_on_a_store(
    tmp_path: Path, s3_bucket: str
) -> None:
    with RecordingWriter(tmp_path / "rec", INFO) as local:
        assert local.flush_bytes == DEFAULT_FLUSH_BYTES == 4 << 20
    with RecordingWriter(f"{s3_bucket}/rec", INFO) as remote:
        assert remote.flush_bytes == DEFAULT_OBJECT_FLUSH_BYTES == 64 << 20
    with pytest.raises(ValueError, match=r"flush_bytes: must be > 0, got 0"):
        RecordingWriter(tmp_path / "other", INFO, flush_bytes=0)
