"""``teacher-server``: serve a teacher model over gRPC + HTTP.

    teacher-server serve [--backend vllm|transformers|replay] [the backend's flags] [options]

The server's flags are the fields of ``ServerConfig`` (``teacher_server/config.py``); each
backend adds its own (``teacher-server serve --backend NAME --help`` lists them), and the
vLLM backend every vLLM engine flag (``AsyncEngineArgs``) too. SIGTERM drains (health
NOT_SERVING, in-flight calls finish within --drain-timeout-s) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from teacher_server import log_filters
from teacher_server.backends.base import Backend
from teacher_server.backends.registry import BACKENDS, backend_class
from teacher_server.config import HttpLimits, ServerConfig
from teacher_server.flags import DefaultsHelpFormatter, add_flags, flag_fields, from_args
from teacher_server.server import run_server
from teacher_server.student_tokenizers import StudentTokenizers

__all__ = [
    "TOKEN_ENV",
    "HttpFlags",
    "ProcessFlags",
    "build_parser",
    "help_sections",
    "main",
    "parse_args",
    "serve",
]

log_filters.install()  # before vLLM is imported (for its flags, even for --help)

#: Environment variable read for the bearer token when --token-file is not given.
TOKEN_ENV = "TOPK_TEACHER_TOKEN"
_DEFAULT_BACKEND = "vllm"


@dataclass(frozen=True)
class ProcessFlags:
    """The flags of the process itself (the server's are ``ServerConfig``'s)."""

    backend: str = field(default=_DEFAULT_BACKEND, metadata={"choices": tuple(BACKENDS)})
    """the engine; the flags listed below are this backend's (serve --backend NAME --help
    lists another one's)"""
    token_file: Path | None = None
    """file holding the shared bearer token (default: $TOPK_TEACHER_TOKEN if set)"""
    log_level: str = field(default_factory=lambda: os.environ.get("TOPK_LOG_LEVEL", "INFO"))
    """logging level ($TOPK_LOG_LEVEL when set)"""


_KIB, _MIB = 1024, 1024 * 1024
_HTTP = HttpLimits()  # the defaults, in bytes and seconds


@dataclass(frozen=True)
class HttpFlags:
    """The HTTP side's limits as flags, in the units people write (``HttpLimits`` holds
    them in bytes and seconds, with the defaults)."""

    http_max_header_kb: int = _HTTP.max_header_bytes // _KIB
    """HTTP: largest request head (KiB); 431 above"""
    http_max_body_mb: int = _HTTP.max_body_bytes // _MIB
    """HTTP: largest request body (MiB); 413 above"""
    http_header_timeout_s: float = _HTTP.header_timeout_s
    """HTTP: a request head must arrive within"""
    http_body_timeout_s: float = _HTTP.body_timeout_s
    """HTTP: a request body must arrive within (408)"""
    http_max_connections: int = _HTTP.max_connections
    """HTTP: connections + requests at once; 503 above"""
    http_keep_alive_s: float = _HTTP.keep_alive_s
    """HTTP: an idle kept-alive connection closes after"""

    def limits(self) -> HttpLimits:
        """The ``HttpLimits`` these flags set (``ValueError`` naming a bad one)."""
        return HttpLimits(
            max_header_bytes=self.http_max_header_kb * _KIB,
            max_body_bytes=self.http_max_body_mb * _MIB,
            header_timeout_s=self.http_header_timeout_s,
            body_timeout_s=self.http_body_timeout_s,
            max_connections=self.http_max_connections,
            keep_alive_s=self.http_keep_alive_s,
        )


#: Every flag dest that is not a backend's own: a backend passing flags on to its engine
#: skips these.
_RESERVED = frozenset(
    f.name for cls in (ProcessFlags, ServerConfig, HttpFlags) for f in flag_fields(cls)
)


def _own_flags(parser: argparse.ArgumentParser, backend: str, *, hidden: bool = False) -> None:
    """The project's own flags of ``serve --backend <backend>``: the process's, the
    server's, the HTTP limits and the backend's own (``hidden``: parse, not listed)."""
    add_flags(parser, ProcessFlags, "teacher-server", hidden=hidden)
    parser.set_defaults(backend=backend)
    add_flags(parser, ServerConfig, "server", hidden=hidden)
    add_flags(parser, HttpFlags, "HTTP limits", hidden=hidden)
    cls = backend_class(backend)
    if hidden:
        add_flags(parser, cls.Flags, hidden=True)
    else:
        cls.add_cli_args(parser)


def serve_parser(backend: str = _DEFAULT_BACKEND) -> argparse.ArgumentParser:
    """The flags of ``teacher-server serve --backend <backend>``: the backend's parents
    (vLLM's engine flags), then the process's, the server's and the backend's own, which
    replace a parent's flag of the same name (as a parent parser: no ``--help``)."""
    parser = argparse.ArgumentParser(
        add_help=False, parents=backend_class(backend).cli_parents(), conflict_handler="resolve"
    )
    _own_flags(parser, backend)
    return parser


_USAGE = f"teacher-server serve [--backend {{{','.join(BACKENDS)}}}] [FLAGS]"
_DESCRIPTION = (
    "Serve a teacher model over gRPC + HTTP. The project's own flags come first: the "
    "process's, the server's, the HTTP limits and the chosen backend's (serve --backend "
    "NAME --help lists another backend's); then the engine's own flags, where the backend "
    "has any (every vLLM engine flag for --backend vllm). SIGTERM drains (health "
    "NOT_SERVING, in-flight calls finish within --drain-timeout-s) and exits 0."
)


def help_sections(backend: str = _DEFAULT_BACKEND) -> list[argparse.ArgumentParser]:
    """What ``serve --help`` prints, in order: the project's own flags (a parser holding
    only those, with the usage and description), then each engine parent's flags less
    those the project's replace."""
    own = argparse.ArgumentParser(
        prog="teacher-server serve",
        usage=_USAGE,
        description=_DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
        conflict_handler="resolve",
    )
    _own_flags(own, backend)
    sections = [own]
    for parent in backend_class(backend).cli_parents():
        engine = argparse.ArgumentParser(
            usage=argparse.SUPPRESS,
            description=f"The engine's own flags (--backend {backend}), from its parser:",
            parents=[parent],
            add_help=False,
            formatter_class=DefaultsHelpFormatter,
            conflict_handler="resolve",
        )
        _own_flags(engine, backend, hidden=True)
        sections.append(engine)
    return sections


class _ServeParser(argparse.ArgumentParser):
    """The ``serve`` parser: it parses every flag (the engine's included), and its
    ``--help`` lists the project's own flags first (:func:`help_sections`)."""

    def __init__(self, *args: Any, backend: str = _DEFAULT_BACKEND, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = backend

    def format_help(self) -> str:
        return "\n".join(p.format_help() for p in help_sections(self.backend))


def build_parser(backend: str = _DEFAULT_BACKEND) -> argparse.ArgumentParser:
    """The ``teacher-server`` parser, ``serve`` with ``backend``'s flags."""
    ap = argparse.ArgumentParser(prog="teacher-server", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_ServeParser)
    sub.add_parser(
        "serve",
        help="serve a teacher model",
        usage=_USAGE,
        description=_DESCRIPTION,
        parents=[serve_parser(backend)],  # type: ignore[list-item]  # any parser is a parent
        formatter_class=DefaultsHelpFormatter,
        backend=backend,
    )
    return ap


def _refusal(backend: str, unknown: list[str]) -> str:
    """Why the flags in ``unknown`` are refused: which backends take them, and the chosen
    backend's note on them."""
    cls = backend_class(backend)
    lines = []
    for flag in (a.split("=", 1)[0] for a in unknown if a.startswith("--")):
        dest = flag[2:].replace("-", "_")
        others = [
            name
            for name in BACKENDS
            if name != backend and dest in {f.name for f in flag_fields(backend_class(name).Flags)}
        ]
        line = f"{flag}: not a flag of --backend {backend}"
        if dest in cls.flag_notes:
            line += f" ({cls.flag_notes[dest]})"
        if others:
            line += f"; it is one of --backend {', '.join(others)}"
        lines.append(line)
    return "; ".join(lines) or f"unrecognized arguments: {' '.join(unknown)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse in two steps: ``--backend`` first, then with that backend's flags (vLLM's
    engine flags, and the import of vLLM they need, only for ``--backend vllm``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", default=_DEFAULT_BACKEND)
    backend = pre.parse_known_args(argv)[0].backend
    if backend not in BACKENDS:  # the full parser reports the choices
        return build_parser().parse_args(argv)
    args, unknown = build_parser(backend).parse_known_args(argv)
    if unknown:
        raise SystemExit(f"teacher-server: {_refusal(backend, unknown)}")
    return args


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        token = args.token_file.read_text().strip()
        if not token:
            raise SystemExit(f"teacher-server: --token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _backend(args: argparse.Namespace, config: ServerConfig) -> Backend:
    cls = backend_class(args.backend)
    return cls.from_cli_args(args, max_top_k=config.max_top_k, reserved=_RESERVED)


def serve(argv: list[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGTERM/SIGINT, drain; the exit code (1: engine failed)."""
    args = parse_args(argv)
    try:
        http = from_args(HttpFlags, args).limits()
        config = from_args(ServerConfig, args, token=_read_token(args), http_limits=http)
    except ValueError as e:
        raise SystemExit(f"teacher-server: {e}") from None
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        students = StudentTokenizers(config.student_tokenizer)
        backend = _backend(args, config)
    except ValueError as e:
        raise SystemExit(f"teacher-server: {e}") from None
    return asyncio.run(run_server(backend, config, students))


def main(argv: list[str] | None = None) -> NoReturn:
    """``teacher-server`` (through :mod:`teacher_server.__main__`, which names a missing
    server extra first): :func:`serve`, then exit at once.

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
