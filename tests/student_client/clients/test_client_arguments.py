"""Construction-time checks of the client's target and token (no teacher needed: the
channel connects lazily)."""

from __future__ import annotations

import pytest

from student_client.clients.blocking import TeacherClient
from student_client.clients.channels import clean_token, parse_targets


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
