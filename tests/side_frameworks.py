"""What the tests of the framework plugins (verl, ms-swift) share: running a driver in a
subprocess whose ``PYTHONPATH`` holds the framework's pinned folder, and a student
tokenizer that may differ from the teacher's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run_driver", "student_tokenizer"]


def run_driver(
    driver: str, spec: dict[str, Any], tmp_path: Path, env: dict[str, str]
) -> dict[str, np.ndarray]:
    """Run ``driver`` (``ARGV: spec.json out.npz``) on ``spec`` under ``env``; its arrays.
    Fails the test with the driver's stderr when it fails."""
    spec_path, out = tmp_path / "spec.json", tmp_path / "out.npz"
    spec_path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-c", driver, str(spec_path), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        return dict(arrays)


def student_tokenizer(model_dir: Path, extra: str | None = None) -> Any:
    """``model_dir``'s tokenizer, with one more token ``extra`` (another vocabulary)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if extra:
        tok.add_tokens([extra])
    return tok
