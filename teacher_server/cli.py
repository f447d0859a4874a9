"""``teacher-server``: serve a teacher model over gRPC + HTTP.

    teacher-server serve --model PATH --port 50051 --http-port 8000 \
        [--max-top-k N] [--backend vllm|transformers|replay] [engine options]

SIGTERM drains (health NOT_SERVING, in-flight calls finish) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from teacher_server.backends.base import Backend, load_backend
from teacher_server.server import ServerConfig, run_server

__all__ = ["build_parser", "main"]

#: Environment variable read for the bearer token when --token-file is not given.
TOKEN_ENV = "TOPK_TEACHER_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="teacher-server", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a teacher model")
    s.add_argument("--model", help="model directory (vllm / transformers backends)")
    s.add_argument("--backend", choices=["vllm", "transformers", "replay"], default="vllm")
    s.add_argument("--recording", help="recording file (replay backend)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    s.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    s.add_argument("--max-top-k", type=int, default=64, help="largest K served")
    s.add_argument("--max-tokens-per-request", type=int, default=262_144)
    s.add_argument("--max-inflight-requests", type=int, default=64)
    s.add_argument("--max-message-mb", type=int, default=64, help="gRPC message size limit")
    s.add_argument("--chunk-kb", type=int, default=1024, help="ScoreStream payload per message")
    s.add_argument("--served-model-name", help="name announced by GetInfo")
    s.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    s.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    s.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding the shared bearer token (default: ${TOKEN_ENV} if set)",
    )
    s.add_argument("--drain-timeout-s", type=float, default=30.0)
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    eng = s.add_argument_group("engine options (vllm / transformers)")
    eng.add_argument("--dtype", default="auto", help="weights dtype (auto, float32, bfloat16, ...)")
    eng.add_argument("--max-model-len", type=int, help="longest sequence + 1")
    eng.add_argument("--tensor-parallel-size", type=int, help="vLLM tensor parallel GPUs")
    eng.add_argument("--gpu-memory-utilization", type=float, help="vLLM GPU memory fraction")
    eng.add_argument("--max-num-batched-tokens", type=int, help="vLLM scheduler token budget")
    eng.add_argument("--max-num-seqs", type=int, help="vLLM concurrent sequences")
    eng.add_argument("--enforce-eager", action="store_true", help="vLLM: no CUDA graphs")
    eng.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        help="extra vLLM AsyncEngineArgs as JSON, e.g. '{\"seed\": 0}'",
    )
    eng.add_argument("--device", default="cpu", help="transformers backend device")
    s.add_argument("--log-level", default=os.environ.get("TOPK_LOG_LEVEL", "INFO"))
    return ap


def _backend_from_args(args: argparse.Namespace) -> Backend:
    if args.backend == "replay":
        if not args.recording:
            raise SystemExit("teacher-server: --recording is required with --backend replay")
        return load_backend("replay", path=args.recording, max_top_k=args.max_top_k)
    if not args.model:
        raise SystemExit(f"teacher-server: --model is required with --backend {args.backend}")
    if args.backend == "transformers":
        return load_backend(
            "transformers",
            model=args.model,
            max_top_k=args.max_top_k,
            dtype="float32" if args.dtype == "auto" else args.dtype,
            device=args.device,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
        )
    engine: dict[str, Any] = {}
    for name in (
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "max_num_batched_tokens",
        "max_num_seqs",
    ):
        value = getattr(args, name)
        if value is not None:
            engine[name] = value
    if args.enforce_eager:
        engine["enforce_eager"] = True
    engine.update(args.engine_args)
    return load_backend(
        "vllm",
        model=args.model,
        max_top_k=args.max_top_k,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        engine_kwargs=engine,
    )


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        token = args.token_file.read_text().strip()
        if not token:
            raise SystemExit(f"teacher-server: --token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        max_top_k=args.max_top_k,
        max_tokens_per_request=args.max_tokens_per_request,
        max_inflight_requests=args.max_inflight_requests,
        max_message_mb=args.max_message_mb,
        chunk_kb=args.chunk_kb,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=_read_token(args),
        drain_timeout_s=args.drain_timeout_s,
        warmup=not args.no_warmup,
    )
    backend = _backend_from_args(args)
    return asyncio.run(run_server(backend, config))


if __name__ == "__main__":
    sys.exit(main())
