"""``make demo``: the main job end to end on the embedded default teacher.

1. Build (once; cached in ``.cache/topk-distill/``) the tiny byte-level teacher.
2. Start ``teacher-server serve`` on it with the vLLM backend; wait for ``/readyz``.
3. Run ``examples/distill.py`` against it: a fresh, smaller student learns from the
   teacher's top-k payloads; the table and a PNG of the curves come out at the end.
4. Stop the server with SIGTERM (it drains) and check that it exited cleanly.

    python -m examples.demo [--steps N] [--out DIR] [--backend vllm|transformers]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from examples import distill
from examples.teacher_pretrain import DEFAULT_CACHE_DIR, PretrainConfig, build_default_teacher

__all__ = ["main", "serve_teacher"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_teacher(
    model: Path, backend: str, log_path: Path, timeout_s: float = 600
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start ``teacher-server serve`` on loopback and wait for ``/readyz``.
    Returns ``(process, grpc_port, http_port)``."""
    port, http_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "teacher_server", "serve",
        "--backend", backend, "--model", str(model), "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--max-top-k", "64", "--max-model-len", "2048",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http_port}/readyz"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"teacher-server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc, port, http_port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"teacher-server not ready after {timeout_s} s; see {log_path}")


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
    args, rest = ap.parse_known_args(argv)
    t0 = time.perf_counter()
    print(f"[1/4] teacher: {args.teacher_dir} (built once, then cached)", flush=True)
    config = PretrainConfig(train_seconds=0, max_steps=args.teacher_steps)
    teacher_dir = build_default_teacher(args.teacher_dir, config=config)
    print(f"[2/4] starting teacher-server ({args.backend} backend) ...", flush=True)
    log_path = args.out / "teacher-server.log"
    proc, port, http_port = serve_teacher(teacher_dir, args.backend, log_path)
    print(f"      ready: gRPC 127.0.0.1:{port}, HTTP http://127.0.0.1:{http_port} "
          f"({time.perf_counter() - t0:.0f} s so far)", flush=True)  # fmt: skip
    try:
        print("[3/4] distilling a fresh student through the client ...", flush=True)
        code = distill.main(
            [
                "--teacher", f"127.0.0.1:{port}",
                "--teacher-dir", str(teacher_dir),
                "--out", str(args.out),
                "--steps", str(args.steps),
                *rest,
            ]
        )  # fmt: skip
    finally:
        print("[4/4] stopping the teacher (SIGTERM, drain) ...", flush=True)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    print(f"      teacher-server exited with {rc}; demo took {time.perf_counter() - t0:.0f} s")
    return code or (1 if rc else 0)


if __name__ == "__main__":
    sys.exit(main())
