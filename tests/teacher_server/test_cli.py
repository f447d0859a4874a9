"""The CLI: defaults in --help, vLLM's own engine flags passed through, the server's own
engine settings kept, other backends parsed without importing vLLM."""

from __future__ import annotations

import pytest

from teacher_server import cli


def test_help_shows_defaults_and_vllm_engine_flags() -> None:
    text = cli._serve_parser(cli.build_parser()).format_help()
    assert "--max-queued-requests" in text and "(default: 1024)" in text
    assert "(default: 30.0)" in text  # --drain-timeout-s
    for flag in ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs"):
        assert flag in text  # vLLM's own parser
    assert "--engine-args" not in text
    for flag in ("--logprobs-path", "--engine-topk"):
        assert flag in text
    args = cli.parse_args(["serve", "--model", "m", "--engine-topk", "kernel"])
    assert (args.logprobs_path, args.engine_topk) == ("auto", "kernel")
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--model", "m", "--engine-topk", "fast"])


def test_vllm_flags_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    args = cli.parse_args(
        [
            "serve", "--model", "m", "--served-model-name", "teacher", "--dtype", "float32",
            "--max-model-len", "4K", "--max-num-seqs", "8", "--enforce-eager",
            "--kv-cache-memory-bytes", "1G", "--enable-prefix-caching", "--max-logprobs", "5",
        ]
    )  # fmt: skip
    assert args.served_model_name == "teacher"  # the server's flag, one name
    assert (args.dtype, args.max_model_len) == ("float32", 4096)
    kwargs = cli._engine_kwargs(args)
    assert kwargs == {
        "max_num_seqs": 8,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1024**3,  # vLLM: 1G = 1 GiB
    }
    warned = caplog.text
    assert "--enable-prefix-caching is set by the server" in warned
    assert "--max-logprobs is set by the server (--max-top-k)" in warned


def test_other_backends_parse_without_vllm_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_vllm_engine_parser", lambda: pytest.fail("vLLM imported"))
    args = cli.parse_args(["serve", "--backend", "transformers", "--model", "m"])
    assert (args.dtype, args.max_model_len) == ("auto", None)
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--backend", "replay", "--gpu-memory-utilization", "0.5"])
