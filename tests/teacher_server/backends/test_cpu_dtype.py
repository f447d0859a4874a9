"""The dtype of a CPU engine: ``--dtype auto`` is float32 where the CPU has no native bf16
and the engine's own choice where it has; an explicit dtype is kept (one warning for an
emulated one). The capability is faked both ways (the rule's argument, the probe's
environment variable); on the CPU the suite runs on, the default is what it was."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest

from teacher_server.backends import cpu_dtype
from teacher_server.backends.cpu_dtype import (
    NO_NATIVE_BF16_ENV,
    checkpoint_dtype,
    cpu_dtype_for,
    cpu_has_native_bf16,
    resolve_cpu_dtype,
)

CHECKPOINTS = ["float32", "bfloat16", "float16", None]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_auto_is_float32_without_native_bf16(checkpoint: str | None) -> None:
    choice = resolve_cpu_dtype("auto", checkpoint, native_bf16=False, capability="AVX2")
    assert choice.dtype == "float32"
    assert not choice.warn
    assert "no native bf16 (AVX2)" in choice.reason


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_auto_is_the_engines_choice_with_native_bf16(checkpoint: str | None) -> None:
    choice = resolve_cpu_dtype("auto", checkpoint, native_bf16=True, capability="AVX512")
    reason = "--dtype auto: this CPU has native bf16 (AVX512); the engine's choice"
    assert choice == ("auto", reason, False)


def test_the_reason_names_what_happens_to_the_checkpoint() -> None:
    kept = resolve_cpu_dtype("auto", "float32", native_bf16=False).reason
    upcast = resolve_cpu_dtype("auto", "bfloat16", native_bf16=False).reason
    assert "kept in float32" in kept
    assert "bfloat16 checkpoint upcast to float32" in upcast


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "half", "BFloat16"])
def test_explicit_half_precision_is_kept_with_a_warning_only_where_emulated(
    requested: str,
) -> None:
    emulated = resolve_cpu_dtype(requested, "float32", native_bf16=False, capability="AVX2")
    assert emulated.dtype == requested and emulated.warn
    assert emulated.reason.startswith(f"--dtype {requested} as given")
    assert "--dtype float32" in emulated.reason
    native = resolve_cpu_dtype(requested, "float32", native_bf16=True)
    assert native == (requested, f"--dtype {requested} as given", False)


@pytest.mark.parametrize("native", [True, False])
def test_explicit_float32_is_kept_quietly(native: bool) -> None:
    assert resolve_cpu_dtype("float32", "bfloat16", native) == (
        "float32",
        "--dtype float32 as given",
        False,
    )


def test_probe_environment_variable_says_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    assert cpu_has_native_bf16() is False
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "0")  # "0" and "" leave it to the CPU
    assert cpu_has_native_bf16() is _torch_says()


@pytest.mark.parametrize(("avx512_bf16", "amx"), [(True, False), (False, True), (False, False)])
def test_probe_follows_torchs_query_on_x86(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool
) -> None:
    import torch

    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)
    monkeypatch.setattr(cpu_dtype.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_has_native_bf16() is (avx512_bf16 or amx)


def test_probe_leaves_other_architectures_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)
    monkeypatch.setattr(cpu_dtype.platform, "machine", lambda: "aarch64")
    assert cpu_has_native_bf16() is True


def _torch_says() -> bool:
    import platform

    import torch

    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"text_config": {"torch_dtype": "float32"}}, "float32"),
        ({"model_type": "qwen2"}, None),
    ],
)
def test_checkpoint_dtype(tmp_path: Path, config: dict[str, object], expected: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(tmp_path) == expected
    assert checkpoint_dtype(tmp_path / "absent") is None
    assert checkpoint_dtype("Qwen/Qwen3-0.6B") is None  # a hub name: not read


def test_default_unchanged_on_this_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the suite runs on: with native bf16, ``auto`` is still the engine's
    choice (what it was before the rule); without, float32."""
    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)
    choice = cpu_dtype_for("auto", tiny_model_dir)
    assert choice.dtype == ("auto" if _torch_says() else "float32"), choice.reason


@pytest.fixture
def bf16_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with ``bfloat16`` as its checkpoint dtype."""
    out = Path(shutil.copytree(tiny_model_dir, tmp_path / "bf16"))
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def _transformers_dtype(model: Path, dtype: str) -> str:
    from teacher_server.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(model, max_top_k=4, dtype=dtype)
    asyncio.run(backend.start())
    return backend.info.dtype


def test_transformers_backend_follows_the_rule(
    bf16_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="teacher_server.backends.transformers_backend")
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    assert _transformers_dtype(bf16_checkpoint, "auto") == "float32"
    assert "computes in float32 (--dtype auto: this CPU has no native bf16" in caplog.text
    caplog.clear()
    assert _transformers_dtype(bf16_checkpoint, "bfloat16") == "bfloat16"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no native bf16" in warnings[0].getMessage()
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "0")
    if _torch_says():  # the checkpoint's dtype, as before the rule
        assert _transformers_dtype(bf16_checkpoint, "auto") == "bfloat16"
