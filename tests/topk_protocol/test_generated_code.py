"""The committed generated code must match ``proto/``: regenerate and compare.

The comparison masks the generator's version stamps (``scripts/gen_proto.py``), so the
verdict depends on ``proto/`` and the committed code, not on the grpcio-tools release
installed today.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from scripts import gen_proto

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    """``make proto`` has been run since the last change to ``proto/``."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def _restamp(folder: Path, grpc_version: str, protobuf_version: tuple[int, int, int]) -> None:
    """Rewrite the generator's version stamps in ``folder`` as another release writes them."""
    grpc_file = folder / "teacher_pb2_grpc.py"
    grpc_file.write_text(
        re.sub(
            r"GRPC_GENERATED_VERSION = '[^']*'",
            f"GRPC_GENERATED_VERSION = '{grpc_version}'",
            grpc_file.read_text(),
        )
    )
    major, minor, patch = protobuf_version
    pb_file = folder / "teacher_pb2.py"
    text = re.sub(
        r"# Protobuf Python Version: .*",
        f"# Protobuf Python Version: {major}.{minor}.{patch}",
        pb_file.read_text(),
    )
    text = re.sub(
        r"(Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,",
        rf"\1\n    {major},\n    {minor},\n    {patch},",
        text,
    )
    pb_file.write_text(text)


def test_another_generator_release_is_still_fresh(tmp_path: Path) -> None:
    """Code written by a grpcio-tools patch release newer or older than the committed one."""
    committed_grpc = (gen_proto.DEFAULT_OUT / "teacher_pb2_grpc.py").read_text()
    committed_pb = (gen_proto.DEFAULT_OUT / "teacher_pb2.py").read_text()
    for grpc_version, protobuf_version in (("1.85.99", (7, 35, 99)), ("1.85.0", (7, 35, 0))):
        fresh = tmp_path / grpc_version
        gen_proto.generate(fresh)
        _restamp(fresh, grpc_version, protobuf_version)
        assert (
            f"GRPC_GENERATED_VERSION = '{grpc_version}'"
            in (fresh / "teacher_pb2_grpc.py").read_text()
        )
        assert (fresh / "teacher_pb2_grpc.py").read_text() != committed_grpc
        assert (fresh / "teacher_pb2.py").read_text() != committed_pb
        assert gen_proto.stale_files(fresh) == []


def test_a_changed_proto_without_regeneration_is_stale(tmp_path: Path) -> None:
    """A field renamed in a copy of ``proto/`` makes the check fail, naming the files."""
    proto_root = tmp_path / "proto"
    shutil.copytree(gen_proto.PROTO_ROOT, proto_root)
    proto = proto_root / gen_proto.PROTO_FILES[0]
    text = proto.read_text()
    assert "string model_name = 1;" in text
    proto.write_text(text.replace("string model_name = 1;", "string model_title = 1;"))
    assert gen_proto.check(proto_root) == ["teacher_pb2.py", "teacher_pb2.pyi"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gen_proto.py"),
            "--check",
            "--proto-root",
            str(proto_root),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "teacher_pb2.py" in result.stderr


def test_a_missing_generated_file_is_stale(tmp_path: Path) -> None:
    committed = tmp_path / "committed"
    shutil.copytree(gen_proto.DEFAULT_OUT, committed)
    (committed / "teacher_pb2.pyi").unlink()
    fresh = tmp_path / "fresh"
    gen_proto.generate(fresh)
    assert gen_proto.stale_files(fresh, committed) == ["teacher_pb2.pyi"]


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
