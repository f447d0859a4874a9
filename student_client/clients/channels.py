"""How a teacher client reaches its targets: target strings, the bearer token, TLS, the
gRPC channel and its options, and which errors are worth a retry."""

from __future__ import annotations

import random
import warnings
from collections.abc import (
    Sequence,
)
from pathlib import Path
from typing import Any

import grpc

from topk_protocol.errors import (
    TeacherError,
    TeacherUnavailableError,
)

__all__ = [
    "backoff_s",
    "channel_credentials",
    "clean_token",
    "give_up",
    "is_retryable",
    "open_channel",
    "parse_targets",
    "positive",
]


#: URL schemes people paste by habit; a gRPC target is host:port or a gRPC URI (dns:///...).
_URL_SCHEMES = frozenset({"http", "https", "grpc", "grpcs"})


def parse_targets(target: str | Sequence[str]) -> list[str]:
    """``"host:port"``, ``"dns:///name:port"``, ``"h1:p1,h2:p2"`` or a list -> targets."""
    if isinstance(target, str):
        items = [target] if target.startswith("dns:") else target.split(",")
    else:
        items = list(target)
    out = [t.strip() for t in items if isinstance(t, str) and t.strip()]
    if not out or len(out) != len(items):
        raise ValueError(f"target: expected host:port, dns:///name:port or a list, got {target!r}")
    for t in out:
        scheme = t.split("://", 1)[0].lower() if "://" in t else ""
        if scheme in _URL_SCHEMES:
            raise ValueError(
                f"target: {t!r} is a URL; gRPC targets take no {scheme}:// prefix: pass "
                f"{t.split('://', 1)[1].rstrip('/')!r} (TLS is the tls= argument)"
            )
    return out


def clean_token(token: str | None) -> str | None:
    """The bearer token as sent: surrounding whitespace (e.g. a token file's trailing
    newline; the server strips its ``--token-file`` too) is removed with a warning."""
    if token is None:
        return None
    stripped = token.strip()
    if not stripped:
        raise ValueError("token: empty (only whitespace)")
    if len(stripped.split()) > 1 or not stripped.isprintable():
        raise ValueError("token: holds whitespace or control characters inside")
    if stripped != token:
        warnings.warn("token: removed surrounding whitespace (a newline?)", stacklevel=4)
    return stripped


def open_channel(
    target: str, credentials: Any, max_message_bytes: int, server_name: str | None
) -> Any:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if target.startswith("dns:"):
        # One subchannel per resolved address, calls spread over them.
        opts.append(("grpc.lb_policy_name", "round_robin"))
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, credentials, options=opts)


def channel_credentials(tls: bool | bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    pem = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def is_retryable(err: TeacherError) -> bool:
    return isinstance(err, TeacherUnavailableError)


def positive(name: str, value: float) -> float:
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")
    return float(value)


def backoff_s(failures: int, first: float, largest: float) -> float:
    """Seconds to wait after ``failures`` failed tries (exponential from ``first`` up to
    ``largest``, with jitter)."""
    return min(largest, first * (2 ** (failures - 1))) * (0.5 + random.random() / 2)


def give_up(failures: int, tries: int, last: TeacherError, targets: Sequence[str]) -> None:
    """Re-raise ``last`` unless it is retryable and fewer than ``tries`` tries failed."""
    if not is_retryable(last):
        raise last from None
    if failures >= tries:
        raise TeacherUnavailableError(
            f"teacher unavailable after {failures} tries ({', '.join(targets)}): {last.message}",
            grpc.StatusCode.UNAVAILABLE,
        )
