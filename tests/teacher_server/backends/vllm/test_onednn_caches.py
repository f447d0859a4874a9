"""oneDNN's caches in the vLLM processes the server starts: the settings, and their
effect on vLLM's own oneDNN linear layers (``create_onednn_mm`` / ``onednn_mm``)
measured as glibc's heap in use, in fresh processes, over many batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from teacher_server.backends.vllm.hooks import SIMULATE_VERSION_ENV
from teacher_server.backends.vllm.onednn_caches import (
    LAYER_CACHE_ENV,
    LAYER_CACHE_SIZES,
    ONEDNN_CACHE_ENV,
    PRIMITIVE_CACHE_CAPACITY,
    bound_caches,
    register,
)

#: ARGV: sizes, marks. The plugin's ``register`` as vLLM's plugin loader calls it, then
#: nine oneDNN layers made as vLLM makes them (32 sizes asked for), each run at
#: ``sizes`` batch sizes; MiB of heap in use (glibc's mallinfo2: in use + mmapped) after
#: each mark, as JSON (null: no oneDNN layers in this vLLM build).
_DRIVER = r"""
import ctypes, json, sys
import torch
import vllm._custom_ops as ops
from teacher_server.backends.vllm.onednn_caches import register

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20

register()
if not ops._supports_onednn:
    print(json.dumps(None)); sys.exit()
torch.manual_seed(0)
layers = [ops.create_onednn_mm(torch.randn(256, 128).t(), 32) for _ in range(9)]
marks = [int(m) for m in sys.argv[2].split(",")]
heap = []
for i in range(1, int(sys.argv[1]) + 1):
    x = torch.randn(64 + 41 * i, 128)
    for layer in layers:
        ops.onednn_mm(layer, x, None)
    if i in marks:
        heap.append(in_use())
print(json.dumps(heap))
"""


def _heap_mib(env: dict[str, str], sizes: int, marks: tuple[int, int]) -> list[float] | None:
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(sizes), ",".join(map(str, marks))],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env(**values: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in (ONEDNN_CACHE_ENV, LAYER_CACHE_ENV)}
    return {**base, **values}


def test_vllm_finds_the_plugin_in_its_general_plugins_group() -> None:
    from importlib.metadata import entry_points

    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    (entry,) = [
        e
        for e in entry_points(group=DEFAULT_PLUGINS_GROUP)
        if e.name == "topk_distill_onednn_layers"
    ]
    assert entry.load() is register
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[entry.name] is register


def test_the_server_s_values_unless_the_operator_set_them() -> None:
    env: dict[str, str] = {}
    assert bound_caches(env) == {
        ONEDNN_CACHE_ENV: str(PRIMITIVE_CACHE_CAPACITY),
        LAYER_CACHE_ENV: str(LAYER_CACHE_SIZES),
    }
    assert env == {ONEDNN_CACHE_ENV: "0", LAYER_CACHE_ENV: "8"}
    assert bound_caches({ONEDNN_CACHE_ENV: "512", LAYER_CACHE_ENV: "32"}) == {
        ONEDNN_CACHE_ENV: "512",
        LAYER_CACHE_ENV: "32",
    }


@pytest.mark.vllm
def test_with_the_process_wide_cache_off_the_layers_stop_growing() -> None:
    """From the 40th batch size to the 160th: with oneDNN's default cache the heap grows
    by each new size's primitives; off, by next to nothing (each layer keeps its last
    32: vLLM's own size, the plugin not asked)."""
    default = _heap_mib(_env(), 160, (40, 160))
    if default is None:
        pytest.skip("this vLLM build has no oneDNN linear layers")
    off = _heap_mib(_env(**{ONEDNN_CACHE_ENV: "0"}), 160, (40, 160))
    assert off is not None
    grew_default, grew_off = default[1] - default[0], off[1] - off[0]
    assert grew_default > 0
    assert grew_off < 0.25 * grew_default, (grew_off, grew_default)  # measured: 0.07


@pytest.mark.vllm
def test_the_plugin_keeps_fewer_sizes_per_layer() -> None:
    """Both with oneDNN's cache off, from the 10th size to the 32nd: vLLM's 32 per layer
    keep growing; the plugin's 8 are full."""
    full = _heap_mib(_env(**{ONEDNN_CACHE_ENV: "0"}), 32, (10, 32))
    if full is None:
        pytest.skip("this vLLM build has no oneDNN linear layers")
    bounded = _heap_mib(_env(**bound_caches({})), 32, (10, 32))
    assert bounded is not None
    grew_full, grew_bounded = full[1] - full[0], bounded[1] - bounded[0]
    assert grew_full > 0
    assert grew_bounded < 0.25 * grew_full, (grew_bounded, grew_full)


def test_another_vllm_release_keeps_vllm_s_cache(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The hook's fallback: under a release it was not checked for, vLLM's function is
    left as it is, one warning names the hook."""
    import vllm._custom_ops as ops

    original = ops.create_onednn_mm
    monkeypatch.setattr(ops, "create_onednn_mm", original)  # restored after the test
    monkeypatch.setenv(LAYER_CACHE_ENV, "8")
    monkeypatch.setenv(SIMULATE_VERSION_ENV, "0.99.0")
    register()
    assert ops.create_onednn_mm is original
    warnings = [r for r in caplog.records if "onednn_layer_cache fell back" in r.getMessage()]
    assert len(warnings) == 1


def test_nothing_changes_where_the_server_did_not_ask(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import vllm._custom_ops as ops

    original = ops.create_onednn_mm
    monkeypatch.setattr(ops, "create_onednn_mm", original)
    monkeypatch.delenv(LAYER_CACHE_ENV, raising=False)
    register()
    assert ops.create_onednn_mm is original
    monkeypatch.setenv(LAYER_CACHE_ENV, "8")
    register()
    register()  # idempotent
    assert ops.create_onednn_mm is not original
    assert ops.create_onednn_mm.__wrapped__ is original
