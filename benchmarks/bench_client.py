"""Student client: payload decode throughput, and what prefetch buys end to end.

1. Decode: a batch's answer (default 8 x 2048 positions, K=64, float16) from wire
   messages to padded ``[B, S, K]`` torch tensors, three ways, in the same run:
   * this client (``ResponseAssembler``: bytes fields, one vectorized copy per chunk);
   * the same arrays as packed *repeated scalar* protobuf fields (int32 ids, float
     log-probs), parsed and turned into tensors with ``torch.tensor(msg.field)``;
   * Python lists: ``struct.unpack`` of the bytes fields, then ``torch.tensor(list)``.
   Reported: positions/s and MB/s of this client's wire bytes (median of ``--reps``).
2. End to end: a vLLM teacher (started here, tiny model, CPU) scores ``--batches``
   batches of ``--batch x --seq-len`` tokens at K=``--k`` float16 through
   ``TeacherClient.stream`` while a stand-in student step (``time.sleep``, GPU-like: it
   leaves the CPU to the teacher) takes ``--student-ms`` per batch (default: the measured
   teacher time per batch). Reported: scored positions/s for each ``--depths``.

    python -m benchmarks.bench_client [--decode-only] [--batches 32] [--depths 0 1 4]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from devtools.launch import TeacherProcess, start_teacher
from student_client.clients.blocking import TeacherClient
from student_client.data.assembler import ResponseAssembler
from topk_protocol import SequenceArrays, build_request, encode_sequence, pb

# -- decode --------------------------------------------------------------------------------


def _repeated_message_class() -> Any:
    """A message type with packed repeated scalars: the naive schema."""
    fd = descriptor_pb2.FileDescriptorProto(name="bench_repeated.proto", package="bench")
    m = fd.message_type.add(name="Rows")
    for i, (name, typ) in enumerate(
        [
            ("ids", descriptor_pb2.FieldDescriptorProto.TYPE_INT32),
            ("logprobs", descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT),
            ("sampled", descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT),
        ],
        start=1,
    ):
        f = m.field.add(name=name, number=i, type=typ)
        f.label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    fd.syntax = "proto3"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Rows"))


def _case(b: int, s: int, k: int, rows_cls: Any) -> tuple[pb.ScoreRequest, bytes, list[bytes], int]:
    """A request, its answer serialized (ours), the same rows as repeated-field messages,
    and the number of payload bytes."""
    rng = np.random.default_rng(0)
    req = build_request(np.zeros((b, s), np.int64), k, dtype="float16", request_id="bench")
    resp = pb.ScoreResponse(request_id="bench", final=True)
    repeated = []
    for i in range(b):
        ids = rng.integers(0, 150_000, size=(s, k), dtype=np.int32)
        lps = -np.sort(rng.exponential(2.0, (s, k)).astype(np.float32), axis=1)
        sampled = -rng.exponential(2.0, s).astype(np.float32)
        arrays = SequenceArrays(ids, lps, sampled)
        resp.sequences.append(encode_sequence(arrays, dtype="float16", sequence_index=i))
        msg = rows_cls()
        msg.ids.extend(ids.ravel().tolist())
        msg.logprobs.extend(lps.ravel().tolist())
        msg.sampled.extend(sampled.tolist())
        repeated.append(msg.SerializeToString())
    payload_bytes = sum(
        len(x.ids) + len(x.logprobs) + len(x.sampled_logprobs) for x in resp.sequences
    )
    return req, resp.SerializeToString(), repeated, payload_bytes


def decode_ours(req: pb.ScoreRequest, wire: bytes) -> torch.Tensor:
    asm = ResponseAssembler(req)
    asm.add(pb.ScoreResponse.FromString(wire))
    return asm.payload().logprobs


def decode_repeated(rows_cls: Any, blobs: list[bytes], s: int, k: int) -> torch.Tensor:
    b = len(blobs)
    ids = torch.zeros(b, s, k, dtype=torch.int64)
    lps = torch.zeros(b, s, k)
    sampled = torch.zeros(b, s)
    for i, blob in enumerate(blobs):
        msg = rows_cls.FromString(blob)
        ids[i] = torch.tensor(msg.ids, dtype=torch.int64).view(s, k)
        lps[i] = torch.tensor(msg.logprobs).view(s, k)
        sampled[i] = torch.tensor(msg.sampled)
    return lps


def decode_lists(wire: bytes, s: int, k: int) -> torch.Tensor:
    resp = pb.ScoreResponse.FromString(wire)
    b = len(resp.sequences)
    ids = torch.zeros(b, s, k, dtype=torch.int64)
    lps = torch.zeros(b, s, k)
    sampled = torch.zeros(b, s)
    for i, c in enumerate(resp.sequences):
        n = c.num_positions * c.top_k
        ids[i] = torch.tensor(list(struct.unpack(f"<{n}i", c.ids))).view(s, k)
        lps[i] = torch.tensor(list(struct.unpack(f"<{n}e", c.logprobs))).view(s, k)
        sampled[i] = torch.tensor(list(struct.unpack(f"<{s}e", c.sampled_logprobs)))
    return lps


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_decode(b: int, s: int, k: int, reps: int) -> list[tuple[str, float, float]]:
    rows_cls = _repeated_message_class()
    req, wire, repeated, nbytes = _case(b, s, k, rows_cls)
    ref = decode_ours(req, wire)
    # The baselines decode the same rows (repeated fields carry float32, not float16).
    assert torch.equal(decode_lists(wire, s, k), ref)
    assert torch.allclose(decode_repeated(rows_cls, repeated, s, k), ref, atol=2e-3, rtol=1e-3)
    out = []
    for name, fn in [
        ("this client (bytes fields, vectorized)", lambda: decode_ours(req, wire)),
        ("packed repeated scalar fields", lambda: decode_repeated(rows_cls, repeated, s, k)),
        ("Python lists (struct.unpack)", lambda: decode_lists(wire, s, k)),
    ]:
        t = _median_time(fn, reps)
        out.append((name, b * s / t, nbytes / t / 1e6))
    return out


# -- end to end ----------------------------------------------------------------------------


def start_vllm(model: Path, max_top_k: int, log: Path) -> TeacherProcess:
    """The vLLM-backed teacher on ``model``, ready."""
    args = [
        "--backend", "vllm", "--model", str(model), "--dtype", "float32",
        "--max-top-k", str(max_top_k), "--max-model-len", "4096",
        "--max-num-batched-tokens", "16384",
    ]  # fmt: skip
    return start_teacher(args, log)


def run_stream(
    client: TeacherClient, batches: list[torch.Tensor], k: int, depth: int, student_s: float
) -> float:
    """Wall seconds to go through every batch: payload, then the student's step."""
    t0 = time.perf_counter()
    for payload in client.stream(batches, k, depth=depth):
        assert payload.mask.all()
        time.sleep(student_s)
    return time.perf_counter() - t0


def bench_end_to_end(
    args: argparse.Namespace,
) -> tuple[list[tuple[int, float, float]], float, float]:
    from devtools.tiny_model import write_tiny_model

    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, 512, (args.batch, args.seq_len), generator=g) for _ in range(args.batches)
    ]
    positions = args.batches * args.batch * args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-model", seed=0)
        server = start_vllm(model, max(64, args.k), Path(tmp) / "server.log")
        target = server.target
        try:
            with TeacherClient(target) as client:
                run_stream(client, batches[:4], args.k, 4, 0.0)  # warm-up
                # Teacher alone: one request at a time, no student step.
                teacher_s = run_stream(client, batches, args.k, 0, 0.0) / args.batches
                student_s = args.student_ms / 1000 if args.student_ms is not None else teacher_s
                rows = []
                for depth in args.depths:
                    wall = run_stream(client, batches, args.k, depth, student_s)
                    rows.append((depth, wall, positions / wall))
        finally:
            server.stop()
    return rows, teacher_s, student_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument(
        "--decode-shape", type=int, nargs=3, default=[8, 2048, 64], metavar=("B", "S", "K")
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--student-ms", type=float, help="student step (default: teacher time)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    b, s, k = args.decode_shape
    print(f"## Decode: {b} x {s} positions, K={k}, float16 -> [B, S, K] torch tensors\n")
    print("| decoder | positions/s | MB/s (wire bytes) | vs this client |")
    print("|---|---:|---:|---:|")
    rows = bench_decode(b, s, k, args.reps)
    for name, pos, mb in rows:
        ratio = "1x" if name == rows[0][0] else f"{rows[0][1] / pos:.1f}x slower"
        print(f"| {name} | {pos:,.0f} | {mb:,.1f} | {ratio} |")
    if args.decode_only:
        return
    e2e, teacher_s, student_s = bench_end_to_end(args)
    print(
        f"\n## End to end: {args.batches} batches x {args.batch} x {args.seq_len} tokens, "
        f"K={args.k}, float16, vLLM tiny teacher on CPU\n"
    )
    print(
        f"teacher alone: {teacher_s * 1000:.0f} ms per batch; student step (sleep): "
        f"{student_s * 1000:.0f} ms per batch\n"
    )
    print("| depth | wall s | scored positions/s |")
    print("|---:|---:|---:|")
    for depth, wall, pos in e2e:
        print(f"| {depth} | {wall:.2f} | {pos:,.0f} |")


if __name__ == "__main__":
    main()
