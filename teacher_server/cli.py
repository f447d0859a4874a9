"""``teacher-server``: serve a teacher model over gRPC + HTTP.

    teacher-server serve --model PATH [--backend vllm|transformers|replay] [options]

With the vLLM backend every vLLM engine flag (``AsyncEngineArgs``) is accepted too.
SIGTERM drains (health NOT_SERVING, in-flight calls finish within --drain-timeout-s) and
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from teacher_server.backends.base import Backend
from teacher_server.backends.registry import BACKENDS, load_backend
from teacher_server.backends.vllm_arrays import LOGPROBS_PATHS
from teacher_server.backends.vllm_worker import ENGINE_TOPK_CHOICES
from teacher_server.backpressure import (
    DEFAULT_STREAM_MAX_UNSENT_MB,
    DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
)
from teacher_server.http_limits import HttpLimits
from teacher_server.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from teacher_server.server import ServerConfig, run_server
from topk_protocol import DEFAULT_TEACHER_TEMPERATURE, check_temperature
from topk_protocol.multi_recording import read_manifest, teacher_recording_path

__all__ = ["TOKEN_ENV", "build_parser", "main", "parse_args", "serve"]

#: Environment variable read for the bearer token when --token-file is not given.
TOKEN_ENV = "TOPK_TEACHER_TOKEN"

#: vLLM engine arguments the server sets itself: its value wins (prefix caching has
#: returned stale prompt log-probs; the engine's max log-probs is --max-top-k).
_SERVER_SET = {
    "max_logprobs": "--max-top-k",
    "enable_prefix_caching": "off",
    "logprobs_mode": "raw_logprobs, which --teacher-temperature relies on",
}
_HELP_FLAGS = ("-h", "--help")


def _vllm_engine_parser() -> tuple[argparse.ArgumentParser, type] | None:
    """vLLM's own engine-argument parser and ``AsyncEngineArgs``; None without vLLM."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    parser = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser, AsyncEngineArgs


def build_parser(*, engine_flags: bool = True) -> argparse.ArgumentParser:
    """The ``teacher-server`` parser. ``engine_flags``: include vLLM's engine flags (imports
    vLLM, which takes seconds; skipped by :func:`main` for the other backends)."""
    ap = argparse.ArgumentParser(prog="teacher-server", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    vllm = _vllm_engine_parser() if engine_flags else None
    s = sub.add_parser(
        "serve",
        help="serve a teacher model",
        description=__doc__,
        parents=[vllm[0]] if vllm else [],
        conflict_handler="resolve",  # the server's own flags below replace vLLM's
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--model", help="model directory (vllm / transformers backends)")
    s.add_argument("--backend", choices=list(BACKENDS), default="vllm")
    s.add_argument("--recording", help="recording directory (replay backend)")
    s.add_argument(
        "--replay-teacher",
        metavar="NAME",
        help="with a multi-teacher recording (replay backend): serve this teacher's rows",
    )
    s.add_argument("--host", default="0.0.0.0", help="gRPC address")
    s.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    s.add_argument("--http-host", help="HTTP address (default: --host)")
    s.add_argument(
        "--http-port", type=int, default=8000, help="HTTP port (0: pick a free one, -1: none)"
    )
    s.add_argument("--max-top-k", type=int, default=64, help="largest K served")
    s.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=262_144,
        help="limit on a request's total tokens",
    )
    s.add_argument(
        "--max-inflight-requests", type=int, default=64, help="requests worked on at once"
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for a slot; more are refused with UNAVAILABLE (clients retry)",
    )
    s.add_argument("--max-message-mb", type=int, default=64, help="gRPC message size limit")
    s.add_argument("--chunk-kb", type=int, default=1024, help="ScoreStream payload per message")
    s.add_argument(
        "--stream-max-unsent-mb",
        type=int,
        default=DEFAULT_STREAM_MAX_UNSENT_MB,
        help="ScoreStream backpressure: answers one stream may hold that its client has not "
        "read; then the stream is not read or scored further (one larger answer still goes, "
        "alone)",
    )
    s.add_argument(
        "--stream-max-unsent-requests",
        type=int,
        default=DEFAULT_STREAM_MAX_UNSENT_REQUESTS,
        help="ScoreStream backpressure: requests one stream may have read but not answered",
    )
    _add_http_limit_flags(s)
    s.add_argument(
        "--served-model-name", help="name announced by GetInfo (default: the model's directory)"
    )
    s.add_argument(
        "--teacher-temperature",
        type=_temperature_arg,
        help="serve log_softmax(logits / T) instead of the model's own distribution "
        "(vllm / transformers; default 1; announced in GetInfo; replay serves the recorded T)",
    )
    s.add_argument("--tls-cert", type=Path, help="certificate (PEM) for gRPC and HTTPS")
    s.add_argument("--tls-key", type=Path, help="private key (PEM) for gRPC and HTTPS")
    s.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding the shared bearer token (default: ${TOKEN_ENV} if set)",
    )
    s.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="SIGTERM: the whole shutdown's budget for requests in flight",
    )
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    s.add_argument("--device", default="cpu", help="torch device (transformers backend)")
    s.add_argument(
        "--logprobs-path",
        choices=LOGPROBS_PATHS,
        default="auto",
        help="vLLM log-prob path: arrays (no Python object per entry), flat (vLLM's "
        "flat_logprobs lists), auto (arrays where the installed vLLM checks out, else flat)",
    )
    s.add_argument(
        "--engine-topk",
        choices=ENGINE_TOPK_CHOICES,
        default="auto",
        help="top-K inside a CPU vLLM engine: kernel (this project's, bit-identical "
        "log-probs, several times faster), vllm (vLLM's torch.topk), auto (kernel where "
        "it checks out; vLLM's on GPUs)",
    )
    s.add_argument("--log-level", default=os.environ.get("TOPK_LOG_LEVEL", "INFO"))
    if vllm is None:
        # Without vLLM's flags, the two engine flags the transformers backend reads.
        s.add_argument(
            "--dtype", default="auto", help="weights dtype (auto: float32 for transformers)"
        )
        s.add_argument(
            "--max-model-len", type=int, help="longest sequence + 1 (transformers backend)"
        )
    return ap


#: ``--http-*`` limit flags: (flag, HttpLimits field, type, unit scale, help).
_HTTP_LIMIT_FLAGS: tuple[tuple[str, str, type, int, str], ...] = (
    ("--http-max-header-kb", "max_header_bytes", int, 1024, "largest request head; 431 above"),
    ("--http-max-body-mb", "max_body_bytes", int, 1024 * 1024, "largest request body; 413 above"),
    ("--http-header-timeout-s", "header_timeout_s", float, 1, "a request head must arrive within"),
    (
        "--http-body-timeout-s",
        "body_timeout_s",
        float,
        1,
        "a request body must arrive within (408)",
    ),
    (
        "--http-max-connections",
        "max_connections",
        int,
        1,
        "connections + requests at once; 503 above",
    ),
    ("--http-keep-alive-s", "keep_alive_s", float, 1, "an idle kept-alive connection closes after"),
)


def _add_http_limit_flags(s: argparse.ArgumentParser) -> None:
    defaults = HttpLimits()
    for flag, field, typ, scale, text in _HTTP_LIMIT_FLAGS:
        default = getattr(defaults, field)
        s.add_argument(
            flag,
            type=typ,
            default=typ(default / scale) if scale > 1 else default,
            help=f"HTTP: {text}",
        )


def _http_limits(args: argparse.Namespace) -> HttpLimits:
    values = {}
    for flag, field, typ, scale, _ in _HTTP_LIMIT_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        values[field] = typ(value * scale)
    try:
        return HttpLimits(**values)
    except ValueError as e:
        raise SystemExit(f"teacher-server: {e}") from None


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM engine arguments given on the command line (those that differ from vLLM's
    defaults), less the ones the server sets itself."""
    vllm = _vllm_engine_parser()
    if vllm is None:
        raise SystemExit("teacher-server: --backend vllm needs vLLM (pip install vllm)")
    parser, engine_args_cls = vllm
    # The server's own flags (--model, --served-model-name, --log-level, ...) replace
    # vLLM's flags of the same name; dtype and max_model_len are passed on by name.
    own = {a.dest for a in _serve_parser(build_parser(engine_flags=False))._actions}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args_cls):
        if f.name in own or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value == parser.get_default(f.name):
            continue
        if f.name in _SERVER_SET:
            logging.getLogger(__name__).warning(
                "--%s is set by the server (%s); ignoring %r",
                f.name.replace("_", "-"),
                _SERVER_SET[f.name],
                value,
            )
            continue
        out[f.name] = value
    return out


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def _temperature_arg(value: str) -> float:
    try:
        return check_temperature(value, "teacher_temperature")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _replay_path(recording: str, teacher: str | None) -> str | Path:
    """The recording to replay: one teacher's part of a multi-teacher recording."""
    names = read_manifest(recording)
    if names is None:
        if teacher:
            raise SystemExit(
                f"teacher-server: --replay-teacher {teacher}: {recording} is a "
                "single-teacher recording"
            )
        return recording
    if teacher not in names:
        raise SystemExit(
            f"teacher-server: {recording} is a multi-teacher recording of {names}: pass "
            f"--replay-teacher NAME (got {teacher!r})"
        )
    return teacher_recording_path(recording, teacher)


def _backend_from_args(args: argparse.Namespace) -> Backend:
    temperature = args.teacher_temperature
    if args.backend == "replay":
        if not args.recording:
            raise SystemExit("teacher-server: --recording is required with --backend replay")
        if temperature is not None:
            raise SystemExit(
                "teacher-server: --teacher-temperature does not apply to --backend replay, "
                "which serves the temperature the recording was made at"
            )
        return load_backend(
            args.backend, path=_replay_path(args.recording, args.replay_teacher),
            max_top_k=args.max_top_k,
        )  # fmt: skip
    if args.replay_teacher:
        raise SystemExit("teacher-server: --replay-teacher applies to --backend replay only")
    temperature = DEFAULT_TEACHER_TEMPERATURE if temperature is None else temperature
    if not args.model:
        raise SystemExit(f"teacher-server: --model is required with --backend {args.backend}")
    if args.backend == "transformers":
        return load_backend(
            args.backend,
            model=args.model,
            max_top_k=args.max_top_k,
            dtype="float32" if args.dtype == "auto" else args.dtype,
            device=args.device,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            temperature=temperature,
        )
    return load_backend(
        args.backend,
        model=args.model,
        max_top_k=args.max_top_k,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        engine_kwargs=_engine_kwargs(args),
        logprobs_path=args.logprobs_path,
        engine_topk=args.engine_topk,
        temperature=temperature,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse in two steps: vLLM's engine flags (and the import of vLLM they need) only for
    ``--backend vllm`` and ``--help``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", default="vllm")
    backend = pre.parse_known_args(argv)[0].backend
    engine_flags = backend == "vllm" or any(a in _HELP_FLAGS for a in argv)
    return build_parser(engine_flags=engine_flags).parse_args(argv)


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        token = args.token_file.read_text().strip()
        if not token:
            raise SystemExit(f"teacher-server: --token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def serve(argv: list[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGTERM/SIGINT, drain; the exit code (1: engine failed)."""
    args = parse_args(argv)
    if args.drain_timeout_s < 0:
        raise SystemExit(
            f"teacher-server: --drain-timeout-s must be >= 0, got {args.drain_timeout_s}"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        http_host=args.http_host,
        http_port=args.http_port,
        max_top_k=args.max_top_k,
        max_tokens_per_request=args.max_tokens_per_request,
        max_inflight_requests=args.max_inflight_requests,
        max_queued_requests=args.max_queued_requests,
        max_message_mb=args.max_message_mb,
        chunk_kb=args.chunk_kb,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=_read_token(args),
        drain_timeout_s=args.drain_timeout_s,
        warmup=not args.no_warmup,
        stream_max_unsent_mb=args.stream_max_unsent_mb,
        stream_max_unsent_requests=args.stream_max_unsent_requests,
        http_limits=_http_limits(args),
    )
    backend = _backend_from_args(args)
    return asyncio.run(run_server(backend, config))


def main(argv: list[str] | None = None) -> NoReturn:
    """``teacher-server`` / ``python -m teacher_server``: :func:`serve`, then exit at once.

    The server has drained and closed the engine by the time :func:`serve` returns; the
    interpreter's own teardown after a vLLM engine (atexit hooks, joining idle worker
    threads, freeing modules) took another 6 s in a measured run, which the drain budget
    (exit within --drain-timeout-s + 5 s) cannot afford. So flush and leave.
    """
    code = serve(argv)
    logging.getLogger(__name__).info("exiting with code %d", code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
