"""The CLI: flags and help text from the config dataclasses, defaults in --help, each
backend's own flags (vLLM's engine flags passed through, the server's own engine
settings kept), other backends parsed without importing vLLM, no per-backend code in
``cli.py``."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from teacher_server import cli
from teacher_server.backends.registry import BACKENDS, backend_class
from teacher_server.backends.vllm import engine_flags as vllm_flags
from teacher_server.config import ServerConfig
from teacher_server.flags import field_docs, flag_fields, from_args


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_shows_defaults_docstrings_and_vllm_engine_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(_help(["serve"], capsys).split())
    assert "--max-queued-requests" in text and "(default: 1024)" in text
    assert "(default: 30.0)" in text  # --drain-timeout-s
    # Every server flag's help is its field's docstring.
    docs = field_docs(ServerConfig)
    for f in flag_fields(ServerConfig):
        assert docs[f.name] in text, f.name
    for flag in ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs"):
        assert flag in text  # vLLM's own parser
    assert "--engine-args" not in text
    for flag in ("--logprobs-path", "--engine-topk"):
        assert flag in text
    args = cli.parse_args(["serve", "--model", "m", "--engine-topk", "kernel"])
    assert (args.logprobs_path, args.engine_topk) == ("auto", "kernel")
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--model", "m", "--engine-topk", "fast"])


def test_server_config_from_flags() -> None:
    args = cli.parse_args(
        ["serve", "--backend", "replay", "--recording", "r", "--max-top-k", "8", "--no-warmup"]
    )
    config = from_args(ServerConfig, args)
    assert config == ServerConfig(max_top_k=8, warmup=False)
    defaults = from_args(
        ServerConfig, cli.parse_args(["serve", "--backend", "replay", "--recording", "r"])
    )
    assert defaults == ServerConfig()
    with pytest.raises(ValueError, match=r"^drain_timeout_s: must be >= 0, got -1"):
        ServerConfig(drain_timeout_s=-1)


def test_vllm_flags_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    args = cli.parse_args(
        [
            "serve", "--model", "m", "--served-model-name", "teacher", "--dtype", "float32",
            "--max-model-len", "4K", "--max-num-seqs", "8", "--enforce-eager",
            "--kv-cache-memory-bytes", "1G", "--no-enable-prefix-caching", "--max-logprobs", "5",
            "--log-level", "DEBUG",
        ]
    )  # fmt: skip
    assert args.served_model_name == "teacher"  # the server's flag, one name
    assert (args.dtype, args.max_model_len) == ("float32", 4096)
    kwargs = vllm_flags.engine_kwargs(args, cli._RESERVED)
    assert kwargs == {
        "max_num_seqs": 8,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1024**3,  # vLLM: 1G = 1 GiB
        "enable_prefix_caching": False,  # the operator's: turns prefix reuse off
    }
    warned = caplog.text
    assert "--enable-prefix-caching" not in warned
    assert "--max-logprobs is set by the server (--max-top-k)" in warned


def test_other_backends_parse_without_vllm_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_flags, "engine_parser", lambda: pytest.fail("vLLM imported"))
    args = cli.parse_args(["serve", "--backend", "transformers", "--model", "m"])
    assert (args.dtype, args.max_model_len, args.teacher_temperature) == ("float32", None, 1.0)
    with pytest.raises(
        SystemExit, match="--gpu-memory-utilization: not a flag of --backend replay"
    ):
        cli.parse_args(
            ["serve", "--backend", "replay", "--recording", "r", "--gpu-memory-utilization", "1"]
        )
    with pytest.raises(
        SystemExit,
        match="--device: not a flag of --backend replay; it is one of --backend transformers",
    ):
        cli.parse_args(["serve", "--backend", "replay", "--recording", "r", "--device", "cpu"])
    with pytest.raises(SystemExit):  # a backend's required flag
        cli.parse_args(["serve", "--backend", "replay"])


def test_each_backend_declares_documented_flags() -> None:
    for name in BACKENDS:
        cls = backend_class(name)
        docs = field_docs(cls.Flags)
        assert {f.name for f in flag_fields(cls.Flags)} <= set(docs), name


def test_cli_names_no_backend_and_reads_no_argparse_internals() -> None:
    source = Path(cli.__file__).read_text()
    tree = ast.parse(source)
    strings = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not any(s in BACKENDS for s in strings - {cli._DEFAULT_BACKEND})
    assert not {"VLLMBackend", "TransformersBackend", "ReplayBackend"} & (names | strings)
    parser = argparse.ArgumentParser()
    private = {a for a in [*dir(parser), *dir(argparse)] if a[0] == "_" and a[:2] != "__"}
    assert not names & private
