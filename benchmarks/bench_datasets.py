"""Payload datasets: bytes on disk per position, and training-loop throughput vs the teacher.

In one run:

1. A vLLM teacher (started here: the tiny test model, CPU) scores ``--sequences``
   sequences of ``--seq-len`` tokens (bytes of the Python standard library's sources) at
   K = ``--k`` float16 through ``TeacherClient.stream`` (depth 4): the *live* baseline, in
   scored positions/s. The same answers are recorded (``record_to=``).
2. Storage: the recorded rows written again as Arrow IPC streams (this project's format)
   and as Parquet with each built-in codec. Reported: bytes on disk per position (the
   wire carries K x (4 + 2) + 2 = 386 bytes per position at K = 64 float16), write and
   read seconds per million positions.
3. ``PayloadDataset`` + ``DataLoader(shuffle=True, collate_fn=collate_payloads)`` over the
   recording for ``--epochs`` epochs (after one warm-up epoch; workers persistent), with
   0 and 2 worker processes: positions/s, and the ratio to the live teacher's.

    python -m benchmarks.bench_datasets [--sequences 128] [--seq-len 512] [--k 64]
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from devtools.launch import start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS, write_tiny_model
from student_client.clients.blocking import TeacherClient
from student_client.offline.dataset import PayloadDataset, collate_payloads
from topk_protocol.recording import RecordingReader

WIRE_BYTES_K64_F16 = 64 * (4 + 2) + 2


def corpus_sequences(n: int, length: int) -> list[np.ndarray]:
    """``n`` windows of ``length`` bytes of the standard library's ``.py`` files."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    data = b"".join(Path(f).read_bytes() for f in files[:200])
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(data) - length, size=n)
    return [np.frombuffer(data[s : s + length], dtype=np.uint8).astype(np.int64) for s in starts]


def live_teacher(args: argparse.Namespace, seqs: list[np.ndarray], rec: Path) -> float:
    """Record the sequences, then time the teacher alone: scored positions/s."""
    batches = [seqs[i : i + args.batch] for i in range(0, len(seqs), args.batch)]
    positions = sum(len(s) for s in seqs)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-model", seed=0)
        server = start_teacher(
            ["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS], Path(tmp) / "log"
        )
        try:
            with TeacherClient(server.target, record_to=rec) as client:
                for _ in client.stream(batches, args.k, depth=4, dtype="float16"):
                    pass
            with TeacherClient(server.target) as client:
                t0 = time.perf_counter()
                for p in client.stream(batches, args.k, depth=4, dtype="float16"):
                    assert p.mask.all()
                live_s = time.perf_counter() - t0
        finally:
            server.stop()
    return positions / live_s


def storage(rec: Path, out: Path) -> list[tuple[str, float, float, float]]:
    """(format, bytes/position, write s and read s per million positions) per codec."""
    with RecordingReader(rec) as r:
        positions = r.num_positions
    table = pa.concat_tables(
        pa.ipc.open_stream(str(f)).read_all() for f in sorted(rec.glob("*.arrow"))
    )
    rows = []
    per_m = 1e6 / positions
    for codec in ("none", "lz4", "zstd"):
        path = out / f"ipc-{codec}.arrow"
        t0 = time.perf_counter()
        with pa.OSFile(str(path), "wb") as sink:
            opts = pa.ipc.IpcWriteOptions(compression=None if codec == "none" else codec)
            with pa.ipc.new_stream(sink, table.schema, options=opts) as w:
                for b in table.to_batches(max_chunksize=16):
                    w.write_batch(b)
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        tr = time.perf_counter() - t0
        rows.append(
            (f"Arrow IPC stream, {codec}", path.stat().st_size / positions, tw * per_m, tr * per_m)
        )
    for codec in ("none", "snappy", "lz4", "zstd"):
        path = out / f"{codec}.parquet"
        t0 = time.perf_counter()
        pq.write_table(table, path, compression=codec, row_group_size=16)
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        pq.read_table(path)
        tr = time.perf_counter() - t0
        rows.append((f"Parquet, {codec}", path.stat().st_size / positions, tw * per_m, tr * per_m))
    return rows


def dataset_throughput(rec: Path, batch: int, epochs: int, workers: int) -> float:
    ds = PayloadDataset(rec)
    loader = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate_payloads,
        persistent_workers=workers > 0,
    )
    for _ in loader:  # warm-up epoch: starts the workers
        pass
    positions = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for b in loader:
            positions += int(b.payload.lengths.sum())
    return positions / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    seqs = corpus_sequences(args.sequences, args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "recording"
        live = live_teacher(args, seqs, rec)
        rows = storage(rec, Path(tmp))
        loaders = [(w, dataset_throughput(rec, args.batch, args.epochs, w)) for w in (0, 2)]
    n = args.sequences * args.seq_len
    print(f"## Storage: {n:,} positions, K={args.k}, float16 (tiny vLLM teacher, V=512)\n")
    wire = args.k * 6 + 2
    print(f"Wire bytes per position: {wire}\n")
    print("| format | bytes/position | vs wire | write s / M positions | read s / M positions |")
    print("|---|---:|---:|---:|---:|")
    for name, bpp, tw, tr in rows:
        print(f"| {name} | {bpp:.1f} | {bpp / wire:.2f}x | {tw:.2f} | {tr:.2f} |")
    print(f"\n## Training-loop throughput (batch {args.batch}, {args.epochs} epochs)\n")
    print("| source | positions/s | vs live teacher |")
    print("|---|---:|---:|")
    print(f"| live tiny vLLM teacher (stream, depth 4) | {live:,.0f} | 1.0x |")
    for w, pos in loaders:
        print(f"| PayloadDataset + DataLoader, num_workers={w} | {pos:,.0f} | {pos / live:.1f}x |")


if __name__ == "__main__":
    main()
