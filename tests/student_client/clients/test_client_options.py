"""Construction-time checks of the client's target and token (no teacher needed: the
channel connects lazily)."""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from typing import Any

import pytest

from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import TeacherClient
from student_client.clients.channels import clean_token, parse_targets
from student_client.clients.client_options import ClientOptions, ClientSettings
from student_client.clients.multi_teacher import AsyncMultiTeacherClient, MultiTeacherClient


@pytest.mark.parametrize(
    ("target", "hint"),
    [
        ("http://teacher:50051", "'teacher:50051'"),
        ("https://teacher:50051/", "'teacher:50051'"),
        ("a:1,grpc://b:2", "'b:2'"),
    ],
)
def test_url_targets_are_rejected_with_the_fix(target: str, hint: str) -> None:
    with pytest.raises(ValueError, match=rf"^target: .* is a URL; .* pass {hint}"):
        TeacherClient(target)


def test_grpc_targets_pass() -> None:
    assert parse_targets("dns:///teacher:50051") == ["dns:///teacher:50051"]
    assert parse_targets("a:1, b:2") == ["a:1", "b:2"]


def test_token_from_a_file_loses_its_newline_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="token: removed surrounding whitespace"):
        client = TeacherClient("127.0.0.1:1", token="s3cret\n")
    with client:
        assert client._aio._targets.connecting.metadata == (("authorization", "Bearer s3cret"),)
    assert clean_token("abc") == "abc" and clean_token(None) is None
    with pytest.raises(ValueError, match="token: holds whitespace"):
        clean_token("abc def")
    with pytest.raises(ValueError, match="token: empty"):
        clean_token(" \n")


def test_the_keywords_are_the_settings_fields_and_defaults_live_there_only() -> None:
    """``ClientOptions`` (the constructors' keywords) names exactly the fields of
    ``ClientSettings``, with the same types; no constructor restates a default."""
    hints = typing.get_type_hints(ClientSettings)
    assert typing.get_type_hints(ClientOptions) == hints
    for client in (AsyncTeacherClient, TeacherClient, AsyncMultiTeacherClient):
        params = inspect.signature(client.__init__).parameters
        assert not set(params) & set(hints), client  # taken as **options only
    client = AsyncTeacherClient("127.0.0.1:1", timeout_s=3, expect_temperature=1)
    assert client.settings == ClientSettings(timeout_s=3.0, expect_temperature=1.0)
    assert ClientSettings().keywords() == {f.name: f.default for f in fields(ClientSettings)}


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"timeout_s": 0}, r"^timeout_s: must be > 0, got 0"),
        ({"retries": -1}, r"^retries: must be >= 0, got -1"),
        ({"max_message_mb": 0}, r"^max_message_mb: must be >= 1, got 0"),
        ({"expect_temperature": -1.0}, r"expect_temperature"),
    ],
)
def test_bad_settings_name_the_keyword(keywords: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TeacherClient("127.0.0.1:1", **keywords)
    with pytest.raises(ValueError, match=message):  # the same check, every teacher's
        MultiTeacherClient({"a": "127.0.0.1:1"}, **keywords)
