"""oneDNN's process-wide primitive cache, off for vLLM's CPU processes: the setting, and
its effect on vLLM's own oneDNN linear layers (``create_onednn_mm`` / ``onednn_mm``)
measured as glibc's heap in use, in fresh processes, over many batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from teacher_server.backends.cpu_onednn_cache import (
    ONEDNN_CACHE_ENV,
    PRIMITIVE_CACHE_CAPACITY,
    bound_primitive_cache,
)

#: ARGV: sizes. Nine layers of vLLM's oneDNN linear (the tiny model's count); MiB of heap
#: in use (glibc's mallinfo2: in use + mmapped) after the first 40 batch sizes and after
#: all of them, as JSON.
_DRIVER = r"""
import ctypes, json, sys
import torch
import vllm._custom_ops as ops

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20

if not ops._supports_onednn:
    print(json.dumps(None)); sys.exit()
torch.manual_seed(0)
layers = [ops.create_onednn_mm(torch.randn(256, 128).t(), 32) for _ in range(9)]
sizes = [64 + 41 * i for i in range(int(sys.argv[1]))]
marks = {}
for i, m in enumerate(sizes, start=1):
    x = torch.randn(m, 128)
    for layer in layers:
        ops.onednn_mm(layer, x, None)
    if i in (40, len(sizes)):
        marks[i] = in_use()
print(json.dumps([marks[40], marks[len(sizes)]]))
"""


def _heap_mib(env: dict[str, str], sizes: int) -> list[float] | None:
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(sizes)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_server_s_value_unless_the_operator_set_one() -> None:
    env: dict[str, str] = {}
    assert bound_primitive_cache(env) == str(PRIMITIVE_CACHE_CAPACITY)
    assert env == {ONEDNN_CACHE_ENV: "0"}
    assert bound_primitive_cache({ONEDNN_CACHE_ENV: "512"}) == "512"


@pytest.mark.vllm
def test_with_the_cache_off_vllm_s_layers_stop_growing_after_their_own_32_sizes() -> None:
    """From the 40th batch size to the 160th: with oneDNN's default cache the heap grows
    by each new size's primitives; with the server's setting, by next to nothing (each
    layer keeps its last 32)."""
    base = {k: v for k, v in os.environ.items() if k != ONEDNN_CACHE_ENV}
    default = _heap_mib(base, 160)
    if default is None:
        pytest.skip("this vLLM build has no oneDNN linear layers")
    bounded = _heap_mib({**base, ONEDNN_CACHE_ENV: bound_primitive_cache({})}, 160)
    assert bounded is not None
    grew_default = default[1] - default[0]
    grew_bounded = bounded[1] - bounded[0]
    assert grew_default > 0  # the cache it bounds is there to bound
    assert grew_bounded < 0.25 * grew_default, (grew_bounded, grew_default)  # measured: 0.07
