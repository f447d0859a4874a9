"""The committed generated code must match ``proto/``: regenerate and compare."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = ROOT / "topk_protocol" / "_generated"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    stale = [n for n in names if (tmp_path / n).read_text() != (committed / n).read_text()]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


_BLOCK_SERVER_PACKAGES = """
import importlib.abc, sys
BLOCKED = ("grpc_tools", "vllm", "fastapi", "uvicorn", "transformers", "grpc_health")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
"""


def test_student_side_imports_without_server_packages() -> None:
    """The wire code works with grpc_tools, vLLM, FastAPI and transformers unavailable."""
    code = _BLOCK_SERVER_PACKAGES + (
        "import numpy as np\n"
        "from topk_protocol import SequenceArrays, encode_sequence, decode_sequence, pb_grpc\n"
        "m = encode_sequence(SequenceArrays(np.zeros((2, 3), np.int32), np.zeros((2, 3))))\n"
        "assert decode_sequence(m).ids.shape == (2, 3)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
