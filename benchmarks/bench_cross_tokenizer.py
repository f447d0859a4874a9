"""A student of another tokenizer against the same text scored in the teacher's tokens,
on one teacher, in one run.

The teacher: the tiny random Qwen2 (vocabulary 512) with a byte-level BPE of 512 ids
learned from the Python standard library's sources; the student tokenizer: a BPE of 400
ids learned from the same files (other merges), served with ``--student-tokenizer``.
``--batch`` (8) texts cut from those files so that each is ``--seq-len`` (2048) student
tokens; the same texts in the teacher's tokens. Per rep, alternating which goes first:

- **teacher tokens**: one ``Score`` request of the texts in the teacher's ids at K;
- **student tokens**: one ``Score`` request of the same texts in the student's ids with
  ``student_tokenizer`` (alignment, the teacher's forward of its own tokens, projection,
  chains), at K.

Both float16, every answer decoded to numpy; vLLM's prefix cache off, so that each
request computes every position it asks for. Reported: medians over ``--reps`` (after a
warm-up) of the seconds, answered positions per second, the paired time ratio (student /
teacher tokens; the goal: at most 1.3x) and the share of masked rows.

    python -m benchmarks.bench_cross_tokenizer [--batch 8] [--seq-len 2048] [--k 64]
        [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from devtools.launch import start_teacher
from devtools.tiny_model import train_bpe_tokenizer, write_tiny_model
from examples.data import load_stdlib_corpus, split_documents
from topk_protocol import decode_sequence, encode_token_ids, pb, pb_grpc

#: As ``bench_teacher``'s: prefix caching off, so every rep computes every position (the
#: same texts are sent again and again; with the cache on, rows would be shared).
ENGINE_ARGS = [
    "--dtype", "float32", "--max-model-len", "4096", "--max-num-batched-tokens", "16384",
    "--no-enable-prefix-caching",
]  # fmt: skip
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def tokenizers(tmp: Path) -> tuple[Path, Path, list[str]]:
    """The teacher's model directory (its BPE tokenizer), the student tokenizer's
    directory, and the training files' texts."""
    corpus = load_stdlib_corpus(max_bytes=3_000_000)
    texts = [d.decode("utf-8", "replace") for d in split_documents(corpus.train)]
    model = write_tiny_model(tmp / "teacher")
    train_bpe_tokenizer(texts, 512).save_pretrained(model)
    student = tmp / "student"
    train_bpe_tokenizer(texts[::2], 400).save_pretrained(student)
    return model, student, texts


def workload(
    texts: list[str], student: Any, teacher: Any, batch: int, length: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``batch`` texts of ``length`` student tokens each: (student ids, teacher ids)."""
    joined = student("\n".join(texts), add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(0)
    s_ids: list[list[int]] = []
    t_ids: list[list[int]] = []
    while len(s_ids) < batch:
        start = int(rng.integers(0, len(joined) - length))
        ids = joined[start : start + length]
        text = student.decode(ids)
        if student(text, add_special_tokens=False)["input_ids"] != ids:
            continue  # a cut the round trip does not reproduce (rare): another one
        s_ids.append(ids)
        t_ids.append(teacher(text, add_special_tokens=False)["input_ids"])
    return s_ids, t_ids


def score(stub: Any, seqs: list[list[int]], k: int, student: str | None) -> tuple[float, int, int]:
    """One ``Score``: seconds, answered positions, masked rows."""
    request = pb.ScoreRequest(request_id="b", top_k=k, dtype=pb.LOGPROB_DTYPE_FLOAT16)
    if student:
        request.student_tokenizer = student
    for s in seqs:
        request.sequences.add(token_ids=encode_token_ids(np.asarray(s, np.int32)))
    t0 = time.perf_counter()
    answer = stub.Score(request, timeout=600)
    rows = [decode_sequence(p) for p in answer.sequences]
    seconds = time.perf_counter() - t0
    positions = sum(r.num_positions for r in rows)
    return seconds, positions, int(answer.row_counts.masked)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-cross-tokenizer-"))
    model, student_dir, texts = tokenizers(tmp)
    s_ids, t_ids = workload(
        texts,
        AutoTokenizer.from_pretrained(student_dir),
        AutoTokenizer.from_pretrained(model),
        a.batch,
        a.seq_len,
    )
    print(
        f"# {a.batch} texts of {a.seq_len} student tokens ({sum(map(len, t_ids))} teacher "
        f"tokens in all), K = {a.k}, reps = {a.reps}, logs in {tmp}",
        flush=True,
    )
    server = start_teacher(
        ["--backend", "vllm", "--model", str(model), *ENGINE_ARGS, "--max-top-k", str(a.k),
         "--student-tokenizer", f"code={student_dir}", "--max-tokens-per-request", "65536"],
        tmp / "teacher.log",
        env=ENV,
    )  # fmt: skip
    runs: dict[str, list[tuple[float, int, int]]] = {"teacher": [], "student": []}
    try:
        with grpc.insecure_channel(
            server.target, options=[("grpc.max_receive_message_length", 256 << 20)]
        ) as channel:
            stub = pb_grpc.TeacherStub(channel)
            for rep in range(a.reps + 1):
                order = ["teacher", "student"] if rep % 2 else ["student", "teacher"]
                for name in order:
                    seqs = t_ids if name == "teacher" else s_ids
                    got = score(stub, seqs, a.k, "code" if name == "student" else None)
                    if rep:
                        runs[name].append(got)
    finally:
        server.stop()
    print("| request | seconds (median) | answered positions/s | masked rows |")
    print("|---|---:|---:|---:|")
    for name, label in (("teacher", "teacher tokens"), ("student", "student tokens, aligned")):
        seconds = statistics.median(r[0] for r in runs[name])
        positions, masked = runs[name][0][1], runs[name][0][2]
        print(f"| {label} | {seconds:.2f} | {positions / seconds:,.0f} | {masked:,} |")
    ratios = [s[0] / t[0] for s, t in zip(runs["student"], runs["teacher"], strict=True)]
    print(
        f"time ratio student / teacher tokens: median {statistics.median(ratios):.2f}x "
        f"(reps: {', '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.3x)"
    )


if __name__ == "__main__":
    main()
