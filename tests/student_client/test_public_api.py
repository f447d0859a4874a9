"""The names a user imports from the package top, and the typing marker."""

from __future__ import annotations

import importlib
from pathlib import Path

import student_client


def test_public_names_at_the_top() -> None:
    from student_client import (
        AsyncTeacherClient,
        ReplayClient,
        TeacherClient,
        fused_topk_kl_loss,
        topk_kl_loss,
    )

    assert TeacherClient.__module__ == "student_client.client"
    assert AsyncTeacherClient.__module__ == "student_client.aio_client"
    assert ReplayClient.__module__ == "student_client.replay"
    assert topk_kl_loss.__module__ == "student_client.losses.api"
    assert fused_topk_kl_loss.__module__.startswith("student_client.losses.")
    for name in student_client.__all__:
        assert hasattr(student_client, name), name


def test_packages_ship_py_typed() -> None:
    for package in ("student_client", "teacher_server", "topk_protocol"):
        root = Path(importlib.import_module(package).__file__ or "").parent
        assert (root / "py.typed").is_file(), package
