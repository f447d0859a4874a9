"""The packed payload encoding: bytes per position, decode and encode speed on one core,
the error, and the scale row (bytes and the recorder's own time for 10^9 positions).

Synthetic payloads at V = 151,936 (a Qwen-sized vocabulary), K = 64: ids uniform over
the vocabulary (no structure left to compress: the worst case for a recording's zstd;
a row may repeat an id, which changes no size),
log-probs the sorted top 64 of a log-softmax over 2,048 Zipf-like logits per row (a
smooth random tail, so every grid step is used). Measured, one thread
(``torch.set_num_threads(1)``, numpy single-threaded), best and median of ``--reps``:

* wire bytes per position of every encoding, from the encoded messages' array fields;
* decode: ``decode_sequence`` (payload message -> float32 ``SequenceArrays``) in
  entries (id, log-prob pairs) per second, the float16 payload as the baseline; encode
  likewise (``encode_sequence``);
* max and mean |packed - float32| of the log-probs, and the stated bound's largest value;
* a recording of ``--record-positions`` positions per encoding (``RecordingWriter``,
  zstd): bytes per position on disk and seconds per million positions for the recorder's
  own work (decode the answer, pack or cast, write), projected to 10^9 positions. The
  teacher's forward pass is not in it.

    python -m benchmarks.bench_packing [--positions 8192] [--reps 7] [--record-positions 65536]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    decode_sequence,
    encode_sequence,
    pb,
)
from topk_protocol.packing import error_bound
from topk_protocol.recording import RecordingWriter

V = 151_936
K = 64
BILLION = 1_000_000_000


def payload(positions: int, seed: int = 0) -> SequenceArrays:
    """``positions`` rows of K ids uniform over V and sorted Zipf-like log-probs."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (positions, K), dtype=np.int32)
    ranks = np.log(np.arange(1, 2049, dtype=np.float32))
    blocks = []
    for start in range(0, positions, 4096):  # 4096 rows of 2048 logits at a time
        n = min(4096, positions - start)
        slope = rng.uniform(0.6, 1.6, (n, 1)).astype(np.float32)
        logits = -slope * ranks + rng.normal(0, 0.5, (n, 2048)).astype(np.float32)
        lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        blocks.append(-np.sort(-lp, axis=1)[:, :K])
    top = np.concatenate(blocks).astype(np.float32)
    sampled = top[np.arange(positions), rng.integers(0, K, positions)]
    return SequenceArrays(ids, top, sampled.astype(np.float32))


def encodings() -> list[tuple[str, RequestOptions]]:
    out = [
        ("default float32", RequestOptions(K, "float32")),
        ("default float16", RequestOptions(K, "float16")),
    ]
    for bits in (4, 6, 8, 10, 12, 16):
        out.append(
            (
                f"packed {bits}-bit",
                RequestOptions(K, "float16", encoding="packed", logprob_bits=bits),
            )
        )
    return out


def _encode(arrays: SequenceArrays, opts: RequestOptions) -> pb.SequencePayload:
    return encode_sequence(arrays, dtype=opts.dtype, packing=opts.packing(V))


def _decode(blob: bytes) -> SequenceArrays:
    """What a client does with an answer's payload: parse, decode to float32."""
    return decode_sequence(pb.SequencePayload.FromString(blob))


def _encode_bytes(arrays: SequenceArrays, opts: RequestOptions) -> bytes:
    """What the teacher does: encode, serialize."""
    return _encode(arrays, opts).SerializeToString()


def _timings(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) seconds of ``reps`` calls: on a shared machine the best is the
    closest to an uncontended core, the median what a busy one gives."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def wire_bytes(msg: pb.SequencePayload) -> int:
    return sum(
        len(getattr(msg, f))
        for f in ("ids", "logprobs", "sampled_logprobs", "packed_ids", "packed_logprobs")
    )


def record(
    arrays: SequenceArrays, opts: RequestOptions, rows: int, root: Path
) -> tuple[float, float]:
    """(bytes per position on disk, recorder seconds per million positions) for
    ``arrays`` cut into ``rows`` sequences, recorded from their encoded answers."""
    info = pb.TeacherInfo(model_name="synthetic", vocab_size=V, max_top_k=K, schema_version=1)
    per = len(arrays) // rows
    tokens = np.arange(per + 1, dtype=np.int32)
    messages = []
    for r in range(rows):
        part = replace(arrays.rows(r * per, (r + 1) * per), position_start=0)
        req = build_request([tokens + r * (per + 1)], opts, request_id=str(r))
        req.sequences[0].position_end = per
        messages.append((req, pb.ScoreResponse(sequences=[_encode(part, opts)], final=True)))
    path = root / opts.encoding / opts.dtype / str(opts.logprob_bits)
    t0 = time.perf_counter()
    with RecordingWriter(path, info, flush_interval_s=3600) as writer:
        for req, resp in messages:
            writer.write(req, resp)
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir())
    return size / (per * rows), seconds / (per * rows) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=8192, help="rows per decoded payload")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--record-positions", type=int, default=65_536)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    arrays = payload(args.positions)
    entries = args.positions * K
    rows = []
    for name, opts in encodings():
        msg = _encode(arrays, opts)
        blob = msg.SerializeToString()
        decode_s = _timings(partial(_decode, blob), args.reps)
        encode_s = _timings(partial(_encode_bytes, arrays, opts), args.reps)
        got = decode_sequence(msg)
        err = np.abs(got.logprobs - arrays.logprobs)
        bound = (
            float(error_bound(arrays.logprobs, opts.logprob_bits, opts.dtype).max())
            if opts.logprob_bits
            else 0.0
        )
        rows.append(
            (
                name,
                opts,
                wire_bytes(msg) / args.positions,
                (entries / decode_s[0], entries / decode_s[1]),
                (entries / encode_s[0], entries / encode_s[1]),
                float(err.max()),
                float(err.mean()),
                bound,
            )
        )
    base = next(r for r in rows if r[0] == "default float16")
    print(f"V = {V:,}, K = {K}, {args.positions} positions, one thread, {args.reps} reps")
    print(
        "| encoding | bytes/position | vs float16 (386) | decode M entries/s, best / median "
        "| best vs float16 decode | encode M entries/s, best / median | max error | mean error "
        "| bound (max) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, _, bpp, dec, enc, emax, emean, bound in rows:
        print(
            f"| {name} | {bpp:.1f} | {bpp / base[2]:.3f}x | {dec[0] / 1e6:.1f} / "
            f"{dec[1] / 1e6:.1f} | {dec[0] / base[3][0]:.2f}x | {enc[0] / 1e6:.1f} / "
            f"{enc[1] / 1e6:.1f} | {emax:.2e} | {emean:.2e} | {bound:.2e} |"
        )
    n = args.record_positions
    rec_arrays = payload(n, seed=1)
    print(
        f"\nScale row: recordings of {n} positions (64 sequences, zstd), "
        "projected to 10^9 positions"
    )
    print(
        "| encoding | wire bytes/position | wire TB per 10^9 | disk bytes/position "
        "| disk TB per 10^9 | recorder s / M positions | recorder hours per 10^9 (one core) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        record(rec_arrays.rows(0, 640), encodings()[0][1], 10, Path(tmp) / "warm-up")
        for name, opts, bpp, *_ in rows:
            disk, s_per_m = record(rec_arrays, opts, 64, Path(tmp))
            print(
                f"| {name} | {bpp:.1f} | {bpp * BILLION / 1e12:.3f} | {disk:.1f} | "
                f"{disk * BILLION / 1e12:.3f} | {s_per_m:.2f} | {s_per_m * 1000 / 3600:.2f} |"
            )
    print(f"\n(os.cpu_count() = {os.cpu_count()}, load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
