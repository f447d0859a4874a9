"""``RequestKeywords``, the options a client call takes by keyword, are exactly
``RequestOptions``' fields besides ``top_k``: an option added to one is added to the
other."""

from __future__ import annotations

from dataclasses import fields

from topk_protocol import RequestOptions
from topk_protocol.requests import RequestKeywords


def test_the_keywords_are_the_options() -> None:
    options = {f.name for f in fields(RequestOptions)} - {"top_k"}
    assert set(RequestKeywords.__annotations__) == options
