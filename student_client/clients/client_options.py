"""A teacher client's options besides its target, written once: :class:`ClientSettings`
(frozen, checked when built) holds each one's default; the keyword lists the clients'
constructors take (``**options: Unpack[ClientOptions]``) name the same fields for
type checkers and IDEs, and a test ties them to it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from student_client.clients.channels import clean_token, positive
from topk_protocol import DEFAULT_MAX_MESSAGE_MB, check_temperature

__all__ = ["ClientOptions", "ClientSettings"]


@dataclass(frozen=True)
class ClientSettings:
    """The options of :class:`~student_client.clients.aio.AsyncTeacherClient` (each
    documented there), shared by the blocking and the multi-teacher clients: how to
    connect and retry, what to expect of the teacher, what to record, and the student
    tokenizer. A bad value raises ``ValueError`` naming it."""

    token: str | None = None
    tls: bool | bytes | str | Path | None = None
    tls_server_name: str | None = None
    timeout_s: float = 120.0
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB
    retries: int = 4
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    expect_vocab_size: int | None = None
    expect_tokenizer_fingerprint: str | None = None
    expect_temperature: float | None = None
    record_to: str | Path | None = None
    record_compression: str = "auto"
    record_metadata: dict[str, Any] | None = None
    student_tokenizer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", positive("timeout_s", self.timeout_s))
        if self.retries < 0:
            raise ValueError(f"retries: must be >= 0, got {self.retries}")
        if self.max_message_mb < 1:
            raise ValueError(f"max_message_mb: must be >= 1, got {self.max_message_mb}")
        object.__setattr__(self, "token", clean_token(self.token))
        if self.expect_temperature is not None:
            temperature = check_temperature(self.expect_temperature, "expect_temperature")
            object.__setattr__(self, "expect_temperature", temperature)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb) * 1024 * 1024

    @property
    def expected(self) -> dict[str, Any]:
        """What the teacher must match: ``TeacherInfo.check_expected``'s keywords."""
        return {
            "vocab_size": self.expect_vocab_size,
            "tokenizer_fingerprint": self.expect_tokenizer_fingerprint,
            "temperature": self.expect_temperature,
        }

    def keywords(self) -> dict[str, Any]:
        """The settings as the clients' keywords (``AsyncTeacherClient(target, **...)``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ClientOptions(TypedDict, total=False):
    """Every field of :class:`ClientSettings` as keywords: what the clients' constructors
    take besides the target (``**options: Unpack[ClientOptions]``: listed by an IDE,
    checked by a type checker; the defaults are :class:`ClientSettings`')."""

    token: str | None
    tls: bool | bytes | str | Path | None
    tls_server_name: str | None
    timeout_s: float
    max_message_mb: int
    retries: int
    backoff_s: float
    max_backoff_s: float
    expect_vocab_size: int | None
    expect_tokenizer_fingerprint: str | None
    expect_temperature: float | None
    record_to: str | Path | None
    record_compression: str
    record_metadata: dict[str, Any] | None
    student_tokenizer: str | None
