"""The suite's rule that every test starting a vLLM engine carries the ``vllm`` marker
(``tests/conftest.py``), so that ``pytest -m "not vllm"`` starts none: both ways it is
enforced fail when broken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, VLLM_FIXTURES

from teacher_server.backends.vllm.backend import NO_ENGINE_ENV, VLLMBackend


def test_an_engine_refuses_to_start_in_a_test_without_the_marker(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """This test has no marker: the variable is set, naming it, and a vLLM engine (in this
    process or any it starts) refuses before vLLM is even imported."""
    assert os.environ[NO_ENGINE_ENV] == f"test {request.node.nodeid} has no @pytest.mark.vllm"
    with pytest.raises(RuntimeError, match=rf"^{NO_ENGINE_ENV}: no vLLM engine may start here"):
        VLLMBackend(tmp_path)._build_engine()


@pytest.mark.vllm
def test_a_test_with_the_marker_may_start_one() -> None:
    assert NO_ENGINE_ENV not in os.environ


def test_a_vllm_fixture_without_the_marker_is_a_collection_error(tmp_path: Path) -> None:
    (fixture,) = VLLM_FIXTURES
    test = tmp_path / "test_unmarked.py"
    test.write_text(f"def test_unmarked({fixture}):\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "--collect-only", "-q", str(test)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert res.returncode == pytest.ExitCode.USAGE_ERROR, res.stdout + res.stderr
    assert f"use ['{fixture}'] (a vLLM engine) without @pytest.mark.vllm" in res.stderr
    assert "test_unmarked.py::test_unmarked" in res.stderr
