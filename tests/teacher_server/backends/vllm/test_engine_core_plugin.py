"""The vLLM general plugin that lets the server trim the engine core: registered as an
entry point vLLM finds, idempotent, and the method it adds trims. Through a real engine
(the server's trim reaching the engine core): ``tests/teacher_server/test_malloc_trim.py``."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
from vllm.v1.engine.core import EngineCore

from teacher_server.backends.vllm.engine_core_plugin import ENGINE_CORE_TRIM_METHOD, register
from teacher_server.backends.vllm.hooks import SIMULATE_VERSION_ENV


def test_vllm_finds_the_plugin_in_its_general_plugins_group() -> None:
    (entry,) = [
        e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == "topk_distill_engine_core"
    ]
    assert entry.load() is register
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[entry.name] is register


def test_register_adds_one_trim_method_once() -> None:
    register()
    method = getattr(EngineCore, ENGINE_CORE_TRIM_METHOD)
    register()  # vLLM may load plugins again in the same process
    assert getattr(EngineCore, ENGINE_CORE_TRIM_METHOD) is method
    given = method(None)  # the method reads nothing of the engine core
    assert isinstance(given, int) and given >= 0


def test_another_vllm_release_adds_nothing(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The hook's fallback: under a release it was not checked for, no method is added
    (the server's trim then logs once and trims the worker only), one warning names it."""
    monkeypatch.delattr(EngineCore, ENGINE_CORE_TRIM_METHOD, raising=False)
    monkeypatch.setenv(SIMULATE_VERSION_ENV, "0.99.0")
    register()
    assert not hasattr(EngineCore, ENGINE_CORE_TRIM_METHOD)
    warnings = [r for r in caplog.records if "engine_core_trim fell back" in r.getMessage()]
    assert len(warnings) == 1
