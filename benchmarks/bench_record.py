"""``teacher-record`` throughput: one recorder against one teacher, two against two replicas.

In one run, on one corpus (``--rows`` random sequences of ``--length`` tokens in a Parquet
file) and the same requests (``--batch-size`` sequences, ``--depth`` in flight, K =
``--top-k`` float16 with sampled log-probs):

1. **teacher alone**: one teacher server (``--backend``, the tiny test model) answers the
   corpus's requests through ``TeacherClient.stream_answers`` with the results dropped (no
   decoding, no recording): the teacher's own positions/s.
2. **one recorder**: ``teacher-record`` (a subprocess) records the corpus from that
   teacher: positions/s over its first request to its last answer (``part.json``).
3. **two replicas alone**: a second server; two clients, each half the requests to one
   replica, at once, results dropped.
4. **two recorders**: ``--num-shards 2``, shard i against replica i, at once: positions/s
   over the first start to the last finish.

Reported: each rate, recorder / teacher (goal >= 0.9) and two recorders / one recorder
(goal >= 1.7), and the CPU seconds of every process (``/proc``), which name the
bottleneck when the machine has fewer cores than the processes need.

    python -m benchmarks.bench_record [--rows 512] [--length 512] [--backend transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from devtools.launch import TeacherProcess, start_teacher
from devtools.tiny_model import write_tiny_model
from student_client.clients.blocking import TeacherClient
from topk_protocol.recording.sharded import part_location, read_part_file

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_corpus(path: Path, rows: int, length: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (rows, length), dtype=np.int32)
    offsets = pa.array(np.arange(0, ids.size + 1, length, dtype=np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.ravel()))})
    pq.write_table(table, path, row_group_size=max(1, rows // 32))  # units for 2 shards
    return [row.astype(np.int64) for row in ids]


def teacher_alone(targets: list[str], seqs: list[np.ndarray], args: argparse.Namespace) -> float:
    """Positions/s of ``targets`` answering ``seqs`` (split evenly, one client each, at
    once), results dropped."""
    share = -(-len(seqs) // len(targets))
    parts = [seqs[i * share : (i + 1) * share] for i in range(len(targets))]
    done = [0] * len(targets)

    def run(i: int) -> None:
        batches = [
            parts[i][j : j + args.batch_size] for j in range(0, len(parts[i]), args.batch_size)
        ]
        with TeacherClient(targets[i]) as client:
            for _ in client.stream_answers(batches, args.top_k, depth=args.depth, dtype="float16"):
                pass
        done[i] = sum(len(s) for s in parts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - t0)


def recorders(
    targets: list[str], corpus: Path, out: Path, args: argparse.Namespace
) -> tuple[float, list[float]]:
    """``len(targets)`` recorders, shard i against target i, at once: positions/s over the
    first start to the last finish (their ``part.json``), and each one's CPU seconds."""
    n = len(targets)
    procs = []
    for i, target in enumerate(targets):
        cmd = [
            sys.executable, "-m", "student_client.offline.record_cli", "--teacher", target,
            "--input", str(corpus), "--output", str(out), "--top-k", str(args.top_k),
            "--batch-size", str(args.batch_size), "--depth", str(args.depth),
            "--shard-index", str(i), "--num-shards", str(n), "--quiet",
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    cpu = []
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        assert p.stdout is not None
        print(p.stdout.read().strip())
        if p.returncode != 0:
            raise SystemExit(f"bench_record: a recorder exited with {p.returncode}")
        cpu.append(usage.ru_utime + usage.ru_stime)
    records = [read_part_file(part_location(out, i, n)) for i in range(n)]
    assert all(r is not None for r in records)
    start = min(r["started_unix"] for r in records if r)
    end = max(r["finished_unix"] for r in records if r)
    return sum(r["scored_positions"] for r in records if r) / (end - start), cpu


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", seed=0)
        seqs = write_corpus(root / "corpus.parquet", args.rows, args.length)
        serve = ["--backend", args.backend, "--model", str(model), "--max-top-k", "64"]
        servers: list[TeacherProcess] = [start_teacher(serve, root / "t0.log")]
        try:
            teacher_alone([servers[0].target], seqs[: 8 * args.batch_size], args)  # warm-up
            cpu0 = cpu_seconds(servers[0].proc.pid)
            one_teacher = teacher_alone([servers[0].target], seqs, args)
            cpu_teacher = cpu_seconds(servers[0].proc.pid) - cpu0
            cpu0 = cpu_seconds(servers[0].proc.pid)
            one_recorder, cpu_rec1 = recorders([servers[0].target], root / "corpus.parquet",
                                               root / "one", args)  # fmt: skip
            cpu_teacher_rec = cpu_seconds(servers[0].proc.pid) - cpu0
            servers.append(start_teacher(serve, root / "t1.log"))
            targets = [s.target for s in servers]
            teacher_alone([targets[1]], seqs[: 8 * args.batch_size], args)  # warm-up
            two_teachers = teacher_alone(targets, seqs, args)
            cpu0s = [cpu_seconds(s.proc.pid) for s in servers]
            two_recorders, cpu_rec2 = recorders(targets, root / "corpus.parquet", root / "two",
                                                args)  # fmt: skip
            cpu_teachers2 = [
                cpu_seconds(s.proc.pid) - c for s, c in zip(servers, cpu0s, strict=True)
            ]
        finally:
            for s in servers:
                s.stop()
    result = {
        "backend": args.backend,
        "corpus": f"{args.rows} x {args.length} tokens, K {args.top_k} float16 + sampled",
        "cpu_cores": os.cpu_count(),
        "one_teacher_positions_per_s": round(one_teacher),
        "one_recorder_positions_per_s": round(one_recorder),
        "recorder_over_teacher": round(one_recorder / one_teacher, 3),
        "two_teachers_positions_per_s": round(two_teachers),
        "two_recorders_positions_per_s": round(two_recorders),
        "two_recorders_over_one": round(two_recorders / one_recorder, 3),
        "cpu_s_teacher_alone": round(cpu_teacher, 1),
        "cpu_s_one_recorder": [round(c, 1) for c in cpu_rec1],
        "cpu_s_teacher_while_recording": round(cpu_teacher_rec, 1),
        "cpu_s_two_recorders": [round(c, 1) for c in cpu_rec2],
        "cpu_s_two_teachers_while_recording": [round(c, 1) for c in cpu_teachers2],
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
