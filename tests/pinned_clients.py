"""Other frameworks' client code at a pinned release, beside the project's environment:
installed ``pip --no-deps --target`` into a cache once, run in a subprocess with it first
on ``PYTHONPATH`` (so its modules never mix with the ones this process imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

__all__ = ["installed_apart", "run_apart"]

ROOT = Path(__file__).resolve().parents[1]


def installed_apart(name: str, requirements: list[str], marker: str) -> Path:
    """The cache folder holding ``requirements`` (exact pins), installed there without
    their dependencies unless ``marker`` (a file path inside it) is already there; the
    calling test is skipped, with pip's words, when they cannot be installed."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    target = cache / "topk-distill" / name
    if not (target / marker).exists():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        done = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"{' '.join(requirements)} could not be installed: {done.stderr[-500:]}")
    return target


def run_apart(target: Path, code: str, args: list[Any]) -> tuple[Any, str]:
    """Run ``code`` with ``target`` then the repository first on ``PYTHONPATH`` and
    ``json.dumps(args)`` as ``sys.argv[1]``; its stdout read as JSON, and its stderr.
    Fails the test, with the tail of stderr, when the code fails."""
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr
