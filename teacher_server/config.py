"""The server's settings, each declared, defaulted and documented once.

:class:`ServerConfig` is what ``teacher-server serve`` takes besides the backend's own
flags: every field is a flag of the same name (``max_top_k`` -> ``--max-top-k``) whose
help text is the field's docstring (:mod:`teacher_server.flags`). The limits the
request pipeline enforces (:class:`teacher_server.validation.Limits`) and the backends' own
``max_top_k`` default read their defaults from here, so each literal is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from teacher_server.fair_share import ADMISSION_ORDERS, FAIR
from teacher_server.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from teacher_server.malloc_trim import DEFAULT_MEMORY_TRIM_IDLE_S
from topk_protocol import DEFAULT_MAX_MESSAGE_MB

__all__ = [
    "DEFAULT_STREAM_MAX_UNSENT_MB",
    "DEFAULT_STREAM_MAX_UNSENT_REQUESTS",
    "MIB",
    "STUDENT_TOKENIZER_FLAG",
    "HttpLimits",
    "ServerConfig",
    "student_tokenizer_spec",
]

MIB = 1024 * 1024

#: ``--stream-max-unsent-mb``: answers one stream may hold unread
#: (:mod:`teacher_server.grpc_api.backpressure`). 8 MiB is 8 answer messages of the
#: default ``--chunk-kb`` (1 MiB), or a prefetch depth of 4 of requests of 2 MiB (about
#: 5,000 positions at K = 64, float32) each; a request whose answer alone is larger is
#: still served, alone.
DEFAULT_STREAM_MAX_UNSENT_MB = 8
#: ``--stream-max-unsent-requests``: requests of one stream read but not fully answered;
#: 16 is four times the client's default prefetch depth.
DEFAULT_STREAM_MAX_UNSENT_REQUESTS = 16

#: The flag naming a student tokenizer (:attr:`ServerConfig.student_tokenizer`).
STUDENT_TOKENIZER_FLAG = "--student-tokenizer"


def student_tokenizer_spec(spec: str) -> tuple[str, Path]:
    """``NAME=DIR`` -> ``(NAME, DIR)``; ``ValueError`` naming the flag and the value
    unless ``NAME`` is non-empty and ``DIR`` an existing directory."""
    name, sep, where = spec.partition("=")
    name = name.strip()
    if not sep or not name or not where:
        raise ValueError(
            f"{STUDENT_TOKENIZER_FLAG} {spec!r}: expected NAME=DIR (a tokenizer directory)"
        )
    path = Path(where).expanduser()
    if not path.is_dir():
        raise ValueError(f"{STUDENT_TOKENIZER_FLAG} {spec!r}: {str(path)!r} is not a directory")
    return name, path


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP side's limits (``teacher-server serve --http-*`` flags).

    ``max_header_bytes``: largest request head (request line + headers), 431 above it.
    ``max_body_bytes``: largest request body, 413 above it.
    ``header_timeout_s``: a request head must arrive within this (else the connection
    is closed); ``body_timeout_s``: a request body within this (else 408).
    ``max_connections``: connections and requests at once (uvicorn ``limit_concurrency``;
    503 above it). ``keep_alive_s``: an idle kept-alive connection is closed after this.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * MIB
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"http {name}: must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"http {name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve; ``max_top_k`` etc. become the request pipeline's ``Limits``."""

    host: str = "0.0.0.0"
    """gRPC address"""
    port: int = 50051
    """gRPC port (0: pick a free one)"""
    http_host: str | None = None
    """HTTP address (default: --host)"""
    http_port: int = 8000
    """HTTP port (0: pick a free one, -1: none)"""
    max_top_k: int = 64
    """largest K served"""
    max_candidates: int = 256
    """largest C of a request's candidate ids per position (scored where the backend
    can; 0: none)"""
    max_tokens_per_request: int = 262_144
    """limit on a request's total tokens"""
    max_inflight_requests: int = 64
    """requests worked on at once"""
    max_queued_requests: int = 1024
    """requests waiting for a slot; more are refused with UNAVAILABLE (clients retry)"""
    admission_order: str = field(default=FAIR, metadata={"choices": ADMISSION_ORDERS})
    """who gets a freed slot: 'fair' takes waiting requests in turn, one per client and
    per stream (docs/operations.md); 'arrival' first come first served"""
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB
    """gRPC message size limit (MiB)"""
    chunk_kb: int = 1024
    """ScoreStream payload per message (KiB)"""
    tls_cert: Path | None = None
    """certificate (PEM) for gRPC and HTTPS"""
    tls_key: Path | None = None
    """private key (PEM) for gRPC and HTTPS"""
    token: str | None = field(default=None, metadata={"flag": False})
    """the shared bearer token (the CLI reads it from --token-file or the environment)"""
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    """SIGTERM: the whole shutdown's budget for requests in flight"""
    warmup: bool = True
    """one warm-up request before the server reports ready (on by default; this flag
    turns it off)"""
    stream_max_unsent_mb: int = DEFAULT_STREAM_MAX_UNSENT_MB
    """ScoreStream backpressure: answers one stream may hold that its client has not read
    (MiB); then the stream is not read or scored further (one larger answer still goes,
    alone)"""
    stream_max_unsent_requests: int = DEFAULT_STREAM_MAX_UNSENT_REQUESTS
    """ScoreStream backpressure: requests one stream may have read but not answered"""
    memory_trim_idle_s: float = DEFAULT_MEMORY_TRIM_IDLE_S
    """once at most one request has been in flight for this many seconds, give the memory
    that the server's and the engine's processes hold freed back to the OS (glibc's
    malloc_trim; once per such quiet spell, and again after a client went leaving answers
    unsent; 0: never)"""
    http_limits: HttpLimits | None = field(default=None, metadata={"flag": False})
    """the HTTP side's limits (None: HttpLimits' defaults; the CLI's --http-* flags)"""
    expect_fingerprint: Path | None = None
    """refuse to become ready unless the answers to the canary sequences agree with this
    reference (a fingerprint JSON, another replica's /v1/info JSON, or a recording
    directory) within the engine's drift (docs/fingerprint.md)"""
    student_tokenizer: tuple[str, ...] = field(default=(), metadata={"metavar": "NAME=DIR"})
    """a student tokenizer this teacher also answers (repeatable): DIR a tokenizer
    directory as transformers saves it; a request naming NAME sends and gets that
    tokenizer's ids (docs/cross_tokenizer.md)"""

    def __post_init__(self) -> None:
        for name in ("max_top_k", "max_tokens_per_request", "max_message_mb", "chunk_kb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "memory_trim_idle_s", "max_candidates"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        specs = tuple(self.student_tokenizer)
        object.__setattr__(self, "student_tokenizer", specs)
        names = [student_tokenizer_spec(spec)[0] for spec in specs]
        for spec, name in zip(specs, names, strict=True):
            if names.count(name) > 1:
                raise ValueError(
                    f"{STUDENT_TOKENIZER_FLAG} {spec!r}: the name {name!r} is given twice"
                )

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * MIB

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_kb * 1024
