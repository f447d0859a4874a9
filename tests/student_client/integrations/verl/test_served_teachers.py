"""Which verl teachers are running topk-distill teachers, and their start-up checks
against a live teacher: each failure a ``ValueError`` naming the setting."""

from __future__ import annotations

import socket

import pytest
from side_frameworks import student_tokenizer

from student_client.integrations.teacher_url import SCHEME
from student_client.integrations.verl.served_teachers import (
    ServedTeacher,
    ServedTeachers,
    served_teachers,
)


def _entry(key: str | None, model_path: str | None) -> dict[str, object]:
    return {"key": key, "model_path": model_path, "num_replicas": 0}


def test_one_teacher_is_verl_s_default_key() -> None:
    cfg = {"teacher_models": {"teacher_model": _entry(None, f"{SCHEME}host:5")}}
    assert served_teachers(cfg) == [
        ServedTeacher("distillation.teacher_models.teacher_model.model_path", "default", "host:5")
    ]


def test_several_teachers_drop_verl_s_default_entry_and_keep_their_keys() -> None:
    cfg = {
        "teacher_models": {
            "teacher_model": _entry(None, None),
            "t_math": _entry("math", f"{SCHEME}a:1,b:2/"),
            "t_code": _entry("code", f"{SCHEME}c:3"),
        }
    }
    got = served_teachers(cfg)
    assert [(t.key, t.target) for t in got] == [("math", "a:1,b:2"), ("code", "c:3")]
    assert got[0].setting == "distillation.teacher_models.t_math.model_path"


def test_teachers_verl_launches_are_left_to_verl() -> None:
    cfg = {"teacher_models": {"teacher_model": _entry(None, "Qwen/Qwen3-8B")}}
    assert served_teachers(cfg) == []


def test_a_mix_and_an_empty_url_are_refused_naming_the_setting() -> None:
    cfg = {
        "teacher_models": {
            "teacher_model": _entry(None, None),
            "a": _entry("x", f"{SCHEME}h:1"),
            "b": _entry("y", "Qwen/Qwen3-8B"),
        }
    }
    with pytest.raises(ValueError, match=r"^distillation.teacher_models.b.model_path: every"):
        served_teachers(cfg)
    empty = {"teacher_models": {"a": _entry("x", SCHEME)}}
    with pytest.raises(
        ValueError, match=r"^distillation.teacher_models.a.model_path: 'topk-distill://' names no"
    ):
        served_teachers(empty)


def _teachers(target: str) -> ServedTeachers:
    return ServedTeachers([ServedTeacher("distillation.teacher_models.t.model_path", "k", target)])


@pytest.mark.vllm
def test_a_matching_teacher_passes_and_announces_itself(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    infos = _teachers(vllm_teacher.target).check(student_tokenizer(tiny_model_dir), 8)
    assert infos["k"].max_top_k == 256


@pytest.mark.vllm
def test_another_tokenizer_names_the_setting(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    other = student_tokenizer(tiny_model_dir, extra="<not-in-the-teacher>")
    with pytest.raises(ValueError, match=r"^distillation.teacher_models.t.model_path: .*tokenizer"):
        _teachers(vllm_teacher.target).check(other, 8)


@pytest.mark.vllm
def test_a_top_k_over_the_teacher_s_names_the_loss_setting(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"^distillation.distillation_loss.topk: 300, but"):
        _teachers(vllm_teacher.target).check(student_tokenizer(tiny_model_dir), 300)


def test_a_wrong_url_names_the_setting(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        ValueError, match=r"^distillation.teacher_models.t.model_path: the teacher at 127"
    ):
        ServedTeachers(
            [ServedTeacher("distillation.teacher_models.t.model_path", "k", f"127.0.0.1:{port}")],
            retries=1,
            timeout_s=5,
        ).check(student_tokenizer(tiny_model_dir), 8)
