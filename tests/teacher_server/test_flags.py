"""Flags from dataclasses: docstrings as help, types, defaults, required fields, bool
switches, choices and converters, and the values read back into the dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from teacher_server.flags import add_flags, field_docs, from_args, temperature_arg


@dataclass(frozen=True)
class _Base:
    name: str
    """what it is called"""


@dataclass(frozen=True)
class _Example(_Base):
    size: int = 3
    """how many,
    over two lines"""
    path: Path | None = None
    """where"""
    fast: bool = True
    """go fast"""
    loud: bool = False
    """make noise"""
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    """which mode"""
    temperature: float = field(default=1.0, metadata={"type": temperature_arg})
    """T"""
    secret: str = field(default="", metadata={"flag": False})
    """not on the command line"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, _Example, "example")
    return p


def test_docstrings_are_the_help_text() -> None:
    docs = field_docs(_Example)
    assert docs["name"] == "what it is called"  # from the base class
    assert docs["size"] == "how many, over two lines"
    text = " ".join(_parser().format_help().split())
    assert "--size SIZE how many, over two lines (default: 3)" in text
    assert "--no-fast go fast" in text and "--loud make noise" in text
    assert "(default: True)" not in text  # a switch shows no default
    assert "--secret" not in text


def test_values_are_typed_and_read_back() -> None:
    p = _parser()
    got = from_args(_Example, p.parse_args(["--name", "n"]), secret="s")
    assert got == _Example(name="n", secret="s")
    args = p.parse_args(
        ["--name", "n", "--size", "7", "--path", "/tmp/x", "--no-fast", "--loud", "--mode", "b"]
    )
    assert from_args(_Example, args) == _Example(
        name="n", size=7, path=Path("/tmp/x"), fast=False, loud=True, mode="b"
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--name", "n", "--size", "x"],
        ["--name", "n", "--mode", "c"],
        ["--name", "n", "--temperature", "0"],
    ],
)
def test_bad_values_are_parse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "--name" in err or "--size" in err or "--mode" in err or "teacher_temperature" in err
