"""The backend table: the CLI offers its names, unknown names are refused."""

from __future__ import annotations

import pytest

from teacher_server.backends.registry import BACKENDS, load_backend
from teacher_server.cli import build_parser, parse_args

#: Each backend's required flag.
REQUIRED = {
    "vllm": ["--model", "m"],
    "transformers": ["--model", "m"],
    "replay": ["--recording", "r"],
}


def test_cli_backend_choices_come_from_the_registry() -> None:
    assert list(BACKENDS) == ["vllm", "transformers", "replay"]
    for name in BACKENDS:
        assert parse_args(["serve", "--backend", name, *REQUIRED[name]]).backend == name
        assert build_parser(name).parse_args(["serve", *REQUIRED[name]]).backend == name
    with pytest.raises(SystemExit):
        parse_args(["serve", "--backend", "onnx"])


def test_unknown_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="backend: unknown backend 'onnx'; use one of vllm"):
        load_backend("onnx")
