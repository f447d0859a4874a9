"""The names a user imports from the package top, and the typing marker."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import student_client


def test_public_names_at_the_top() -> None:
    from student_client import (
        AsyncTeacherClient,
        LossOptions,
        ReplayClient,
        TeacherClient,
        TeacherTargets,
        lm_head_topk_kl_loss,
        topk_kl_loss,
    )

    assert TeacherClient.__module__ == "student_client.clients.blocking"
    assert AsyncTeacherClient.__module__ == "student_client.clients.aio"
    assert ReplayClient.__module__ == "student_client.offline.replay_client"
    assert topk_kl_loss.__module__ == "student_client.losses.topk_kl"
    assert lm_head_topk_kl_loss.__module__ == "student_client.losses.lm_head_topk_kl"
    assert LossOptions.__module__ == "student_client.losses.options"
    assert TeacherTargets.__module__ == "student_client.losses.teacher"
    for name in student_client.__all__:
        assert hasattr(student_client, name), name


def test_the_namespace_holds_only_the_public_names() -> None:
    """``import student_client`` exposes its ``__all__`` (no ``Any``, ``TYPE_CHECKING``,
    ``importlib``): every other name of the module is a dunder, private, or one of its
    sub-packages (set by importing them)."""
    packages = {"clients", "data", "integrations", "losses", "offline"}
    public = {n for n in vars(student_client) if not n.startswith("_")}
    allowed = set(student_client.__all__) | packages
    assert public <= allowed, sorted(public - allowed)
    assert {"Any", "TYPE_CHECKING", "importlib", "annotations"}.isdisjoint(dir(student_client))


def test_the_losses_export_at_most_sixteen_names() -> None:
    import student_client.losses as losses

    assert len(losses.__all__) <= 16, losses.__all__
    for name in losses.__all__:
        assert hasattr(losses, name), name


def test_packages_ship_py_typed() -> None:
    for package in ("student_client", "teacher_server", "topk_protocol"):
        root = Path(importlib.import_module(package).__file__ or "").parent
        assert (root / "py.typed").is_file(), package


def _modules_after(statement: str) -> set[str]:
    """The top-level modules loaded by ``statement`` in a fresh interpreter."""
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return {name.split(".")[0] for name in out.split()}


HEAVY = {"grpc", "pyarrow", "transformers", "google"}


@pytest.mark.parametrize(
    "statement",
    [
        "import student_client.losses",
        "from student_client.losses import topk_kl_loss, lm_head_topk_kl_loss",
        "from student_client import topk_kl_loss",
        "import student_client.integrations.distillation",
    ],
)
def test_the_losses_load_no_transport_storage_or_framework(statement: str) -> None:
    """The losses (and the Trainer's loss function) are pure torch at run time, not only
    in the source: no grpc, pyarrow, protobuf or transformers gets imported."""
    loaded = _modules_after(statement)
    assert "torch" in loaded  # the check can see what an import loads
    assert not loaded & HEAVY, sorted(loaded & HEAVY)


def test_the_check_sees_a_heavy_import() -> None:
    """The fresh-interpreter check above would fail on a client import."""
    assert {"grpc", "pyarrow"} <= _modules_after("import student_client.clients.blocking")


REPO = Path(__file__).resolve().parents[2]


def test_the_package_top_holds_only_its_packages() -> None:
    """``student_client/`` lists its sub-packages and ``__init__`` (no stub modules of old
    paths; ``CHANGELOG.md`` names each moved name's home)."""
    entries = {p.name for p in (REPO / "student_client").iterdir() if p.name != "__pycache__"}
    modules = {e for e in entries if e.endswith(".py")}
    assert modules == {"__init__.py"}, sorted(modules)
    assert {"clients", "data", "integrations", "losses", "offline"} <= entries


@pytest.mark.parametrize(
    "old",
    [
        "student_client.client",
        "student_client.replay",
        "student_client.errors",
        "teacher_server.entry",
    ],
)
def test_old_module_paths_are_gone(old: str) -> None:
    """(Checked on the tree: a shared editable install may still resolve the name.)"""
    path = REPO / (old.replace(".", "/") + ".py")
    assert not path.exists() and not path.with_suffix("").exists()


def test_no_module_warns_of_its_own_deprecation() -> None:
    """No package module emits a ``DeprecationWarning`` of its own."""
    offenders = [
        str(path.relative_to(REPO))
        for package in ("student_client", "teacher_server", "topk_protocol")
        for path in (REPO / package).rglob("*.py")
        if "DeprecationWarning" in path.read_text()
    ]
    assert offenders == []
