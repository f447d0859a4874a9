"""A framework's teacher setting names a running teacher by ``topk-distill://`` URL."""

from __future__ import annotations

import pytest

from student_client.integrations.teacher_url import SCHEME, served_target


def test_the_target_follows_the_scheme_one_or_several() -> None:
    assert served_target(f"{SCHEME}teacher:50051", "s") == "teacher:50051"
    assert served_target(f"{SCHEME} a:1,b:2/ ", "s") == "a:1,b:2"


def test_other_values_are_left_to_the_framework() -> None:
    for value in ("http://teacher:8000", "Qwen/Qwen3-8B", "/models/q", None, 7):
        assert served_target(value, "s") is None


def test_a_url_without_a_host_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"^--teacher_model_server: 'topk-distill:///' names no"):
        served_target(f"{SCHEME}/", "--teacher_model_server")
