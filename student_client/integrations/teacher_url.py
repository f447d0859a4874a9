"""How a framework's teacher setting names a running topk-distill teacher.

A trainer's own teacher setting (verl's ``distillation.teacher_models.<name>.model_path``,
ms-swift's ``--teacher_model_server``) holds a URL of the scheme :data:`SCHEME`, then the
teacher's gRPC target, several comma-separated for fail-over:
``topk-distill://teacher-host:50051`` or ``topk-distill://a:50051,b:50051``. Any other
value is left to the framework.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEME", "served_target"]

#: The scheme of a running topk-distill teacher's URL.
SCHEME = "topk-distill://"


def served_target(url: Any, setting: str) -> str | None:
    """The gRPC target(s) in ``url`` (``topk-distill://host:port[,host:port]``), or None
    for a value that names no running topk-distill teacher. Raises ``ValueError`` naming
    ``setting`` (the framework's name for where ``url`` came from) when the URL names no
    host.

    >>> served_target("topk-distill://teacher:50051/", "model_path")
    'teacher:50051'
    >>> served_target("Qwen/Qwen3-8B", "model_path") is None
    True
    """
    if not isinstance(url, str) or not url.startswith(SCHEME):
        return None
    target = url[len(SCHEME) :].strip().rstrip("/")
    if not target:
        raise ValueError(f"{setting}: {url!r} names no host:port after {SCHEME}")
    return target
