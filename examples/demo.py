"""``make demo``: the main job end to end on the embedded default teacher.

1. Build (once; cached in ``.cache/topk-distill/``) the tiny byte-level teacher.
2. Start ``teacher-server serve`` on it with the vLLM backend; wait for ``/readyz``.
3. Run ``examples/distill.py`` against it: a fresh, smaller student learns from the
   teacher's top-k payloads; the table and a PNG of the curves come out at the end.
4. Stop the server with SIGTERM (it drains) and check that it exited cleanly.

    python -m examples.demo [--steps N] [--out DIR] [--backend vllm|transformers]
        [--loss-mode tail|truncated] [--fused | --no-fused] [--teacher-temperature T]

Flags it does not know go to ``examples/distill.py``: by default the student trains with
the fused lm_head loss (``--no-fused``: logits + ``topk_kl_loss``) in tail mode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from devtools.launch import TeacherProcess, start_teacher
from examples import distill
from examples.teacher_pretrain import DEFAULT_CACHE_DIR, PretrainConfig, build_default_teacher

__all__ = ["main", "serve_teacher"]


def serve_teacher(
    model: Path, backend: str, log_path: Path, temperature: float = 1.0
) -> TeacherProcess:
    """``teacher-server serve`` on ``model`` (loopback, free ports) at ``temperature``, ready."""
    args = [
        "--backend", backend, "--model", str(model), "--dtype", "float32",
        "--max-top-k", "64", "--max-model-len", "2048",
        "--teacher-temperature", str(temperature),
    ]  # fmt: skip
    return start_teacher(args, log_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.demo", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    ap.add_argument("--teacher-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument(
        "--teacher-steps",
        type=int,
        default=300,
        help="pretraining steps of the teacher (a step budget, not a time budget, so that "
        "the teacher is the same on every machine)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    ap.add_argument("--steps", type=int, default=distill.DistillConfig.steps)
    ap.add_argument(
        "--teacher-temperature",
        type=float,
        default=distill.DistillConfig.teacher_temperature,
        help="the teacher serves at T and the student's loss matches it",
    )
    args, rest = ap.parse_known_args(argv)
    t0 = time.perf_counter()
    print(f"[1/4] teacher: {args.teacher_dir} (built once, then cached)", flush=True)
    config = PretrainConfig(train_seconds=0, max_steps=args.teacher_steps)
    teacher_dir = build_default_teacher(args.teacher_dir, config=config)
    print(f"[2/4] starting teacher-server ({args.backend} backend) ...", flush=True)
    log_path = args.out / "teacher-server.log"
    server = serve_teacher(teacher_dir, args.backend, log_path, args.teacher_temperature)
    print(f"      ready: gRPC {server.target}, HTTP {server.http} "
          f"({time.perf_counter() - t0:.0f} s so far)", flush=True)  # fmt: skip
    try:
        print("[3/4] distilling a fresh student through the client ...", flush=True)
        code = distill.main(
            [
                "--teacher", server.target,
                "--teacher-dir", str(teacher_dir),
                "--out", str(args.out),
                "--steps", str(args.steps),
                "--teacher-temperature", str(args.teacher_temperature),
                *rest,
            ]
        )  # fmt: skip
    finally:
        print("[4/4] stopping the teacher (SIGTERM, drain) ...", flush=True)
        rc = server.stop(timeout_s=120)
    print(f"      teacher-server exited with {rc}; demo took {time.perf_counter() - t0:.0f} s")
    return code or (1 if rc else 0)


if __name__ == "__main__":
    sys.exit(main())
