"""PayloadDataset streams a recording from object storage (a real S3-compatible server:
moto's server mode on loopback): its items are the local recording's, a DataLoader's
worker processes read it, and the memory it takes is a few record batches, not the
recording (peak measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch
from recording_fakes import INFO, K
from torch.utils.data import DataLoader

from student_client.offline.dataset import PayloadDataset, collate_payloads
from topk_protocol import SequenceArrays
from topk_protocol.recording import RecordingWriter
from topk_protocol.recording.reader import INDEX_READ_BUFFER_BYTES, REMOTE_CACHED_BATCHES
from topk_protocol.storage import Location

ROOT = Path(__file__).resolve().parents[3]


def write(path: str | Path, rows: int, positions: int, rows_per_batch: int) -> None:
    """``rows`` sequences of ``positions`` tokens, float32, uncompressed (bytes = memory),
    one record batch (one object on S3) per ``rows_per_batch`` rows."""
    with RecordingWriter(path, INFO, flush_interval_s=3600, compression="none") as w:
        for i in range(rows):
            rng = np.random.default_rng(i)
            tokens = rng.integers(0, INFO.vocab_size, positions).astype(np.int32)
            ids = rng.integers(0, INFO.vocab_size, (positions, K)).astype(np.int32)
            lps = -np.sort(rng.exponential(2.0, (positions, K)).astype(np.float32), axis=1)
            w.add(tokens, SequenceArrays(ids, lps, None, 0), dtype="float32")
            if (i + 1) % rows_per_batch == 0:
                w.flush()


def test_items_from_s3_equal_the_local_ones_through_a_dataloader(
    s3_bucket: str, tmp_path: Path
) -> None:
    uri = f"{s3_bucket}/ds"
    for path in (uri, tmp_path / "local"):
        write(path, rows=37, positions=23, rows_per_batch=5)
    remote, local = (
        PayloadDataset(uri, top_k=5, dtype="bfloat16", include_sampled=False),
        PayloadDataset(tmp_path / "local", top_k=5, dtype="bfloat16", include_sampled=False),
    )
    assert remote.path == uri and len(remote) == len(local) == 37
    for i in (0, 36, 7, 7, 20):
        a, b = remote[i], local[i]
        assert torch.equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.arrays.ids, b.arrays.ids)
        assert np.array_equal(a.arrays.logprobs.view(np.int32), b.arrays.logprobs.view(np.int32))
    # worker processes (spawned: each reopens the recording from its URI)
    loader = DataLoader(
        remote,
        batch_size=8,
        num_workers=2,
        multiprocessing_context="spawn",
        collate_fn=collate_payloads,
    )
    seen = torch.cat([b.token_ids for b in loader])
    assert torch.equal(seen, torch.stack([local[i].token_ids for i in range(37)]))


_MEASURE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    import pyarrow as pa
    from student_client.offline.dataset import PayloadDataset

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    pool = pa.default_memory_pool()
    ds = PayloadDataset({uri!r}, include_sampled=False)  # import everything first
    ds = None
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := RSS now
    before = status("VmRSS")
    arrow_before = pool.max_memory()
    ds = PayloadDataset({uri!r}, include_sampled=False)
    total = 0
    for i in range(len(ds)):
        total += int(ds[i].token_ids.sum())
    print(json.dumps({{"rows": len(ds), "token_sum": total,
                      "rss_growth": status("VmHWM") - before,
                      "arrow_peak": pool.max_memory(), "arrow_before": arrow_before,
                      "pool": pool.backend_name}}))
    """
)


def test_payload_dataset_streams_from_s3_with_bounded_memory(s3_bucket: str) -> None:
    uri = f"{s3_bucket}/big"
    rows, positions, per_batch = 480, 1000, 8
    write(uri, rows, positions, per_batch)
    loc = Location.of(uri)
    size = sum(n for _, n in loc.files(".arrow"))
    batch_bytes = size / (rows / per_batch)
    assert size > 60e6  # the recording: ~64 MB
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(root=str(ROOT), uri=uri)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want_sum = sum(
        int(np.random.default_rng(i).integers(0, INFO.vocab_size, positions).sum())
        for i in range(rows)
    )
    assert got["rows"] == rows and got["token_sum"] == want_sum
    bound = (REMOTE_CACHED_BATCHES + 2) * batch_bytes + INDEX_READ_BUFFER_BYTES
    print(
        f"recording {size / 2**20:.1f} MiB in {rows // per_batch} batches of "
        f"{batch_bytes / 2**20:.2f} MiB; Arrow pool peak {got['arrow_peak'] / 2**20:.1f} MiB "
        f"({got['pool']}), peak RSS growth {got['rss_growth'] / 2**20:.1f} MiB"
    )
    assert got["arrow_peak"] < bound
    assert got["rss_growth"] < size / 4
