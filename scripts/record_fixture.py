"""Regenerate ``tests/data/tiny_vllm_recording/``: a small recording (a payload dataset
directory, :mod:`topk_protocol.recording`) of the real vLLM-backed teacher on the tiny
test model (``write_tiny_model(seed=0)``, vocab 512).

    python -m scripts.record_fixture [--out DIR] [--compression zstd|lz4|none]

Starts ``teacher-server serve --backend vllm`` itself with the engine settings of the
``vllm_teacher`` test fixture (float32 weights, max K 256), records at K = 64 in float32
(so that replay can serve every K' <= 64 and every dtype) a few requests that cover the
payload's facets (ragged batches through ``stream``, a sub-range of positions, a
sequence without sampled log-probs, a longer sequence), then asks every request again
(alone and in another batch) and reports whether the engine answered bit-identically.
The tests replay it against the live engine of their own run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from devtools.launch import TeacherProcess, start_teacher
from devtools.tiny_model import TINY_SERVE_ARGS
from student_client.clients.blocking import TeacherClient
from student_client.data.payload import TeacherPayload

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "tiny_vllm_recording"
TOP_K = 64
DTYPE = "float32"
TEXTS = [
    b"def main():\n    return 0\n",
    b"import numpy as np\nx = np.arange(10)\n",
    b"for i in range(3):\n    print(i)\n",
    b"class A:\n    pass\n",
    b"with open(path) as f:\n    data = f.read()\n",
    b"# comment\n",
    b"x = [i * i for i in range(8)]\n",
]


def _tokens(text: bytes) -> list[int]:
    return list(text)  # the tiny tokenizer is byte-level: ids 0..255 are the bytes


def start_vllm(model: Path, log_path: Path) -> TeacherProcess:
    """Start the vLLM-backed teacher on the tiny model and wait until it is ready."""
    return start_teacher(["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS], log_path)


def record(client: TeacherClient) -> list[TeacherPayload]:
    """The fixture's requests; returns the payloads in order."""
    rng = np.random.default_rng(1234)
    out = list(
        client.stream(
            [
                [_tokens(TEXTS[0]), _tokens(TEXTS[1]), _tokens(TEXTS[3])],
                [_tokens(TEXTS[2])],
                [_tokens(TEXTS[5])],
            ],
            TOP_K,
            depth=2,
            dtype=DTYPE,
        )
    )
    # Only positions [10, 35) of this one; the next one without sampled log-probs.
    out.append(client.score([_tokens(TEXTS[4])], TOP_K, dtype=DTYPE, positions=[(10, 35)]))
    out.append(client.score([_tokens(TEXTS[6])], TOP_K, dtype=DTYPE, include_sampled=False))
    long_seq = torch.from_numpy(rng.integers(0, 512, size=300))
    out.append(client.score(long_seq[None], TOP_K, dtype=DTYPE))
    return out


def _same(a: TeacherPayload, b: TeacherPayload) -> bool:
    def eq(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is y
        return bool(torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0)))

    return (
        eq(a.ids, b.ids)
        and eq(a.logprobs, b.logprobs)
        and eq(a.sampled_logprobs, b.sampled_logprobs)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "none"])
    args = ap.parse_args(argv)
    from devtools.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-model", seed=0)
        server = start_vllm(model, Path(tmp) / "server.log")
        target = server.target
        try:
            if args.out.exists():
                shutil.rmtree(args.out)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"model": "devtools.tiny_model.write_tiny_model(seed=0)"}
            with TeacherClient(
                target,
                record_to=args.out,
                record_compression=args.compression,
                record_metadata=meta,
            ) as client:
                first = record(client)
            with TeacherClient(target) as client:
                again = record(client)
                # Batch 0's third sequence, alone: same rows as inside its batch?
                n = len(TEXTS[3])
                alone = client.score([_tokens(TEXTS[3])], TOP_K, dtype=DTYPE)
                rebatched = bool(
                    torch.equal(alone.ids[0, :n], first[0].ids[2, :n])
                    and torch.equal(alone.logprobs[0, :n], first[0].logprobs[2, :n])
                )
        finally:
            server.stop()
    same = all(_same(a, b) for a, b in zip(first, again, strict=True))
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size} bytes, {len(first)} requests)")
    print(f"engine bit-identical on repeated requests: {same}; alone vs in a batch: {rebatched}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
