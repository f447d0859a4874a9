"""The dtype a CPU engine computes in when the operator gave ``--dtype auto``.

On a CPU without native bfloat16 arithmetic (x86 without AVX-512 BF16 or AMX) PyTorch
emulates bf16, and vLLM's ``auto`` still downcasts a float32 checkpoint to bf16 on CPU.
There ``auto`` means float32 here, whatever the checkpoint's dtype: a float32 checkpoint
stays float32, and a bfloat16 or float16 checkpoint is upcast to float32, which is
exact (an x86 CPU without native bf16 has no native fp16 arithmetic either). Where the
CPU has native bf16 (or its capability is not known to this module: non-x86 CPUs, where
vLLM applies its own platform rules), ``auto`` is left to the engine. A dtype given
explicitly is kept; a half-precision one on a CPU without native bf16 comes with one
warning. docs/operations.md, "The dtype on CPU".

:func:`resolve_cpu_dtype` is the rule (pure); :func:`cpu_has_native_bf16` the probe.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "AUTO",
    "NO_NATIVE_BF16_ENV",
    "CpuDtype",
    "checkpoint_dtype",
    "cpu_capability",
    "cpu_dtype_for",
    "cpu_has_native_bf16",
    "resolve_cpu_dtype",
]

AUTO = "auto"
#: Set (to anything but ``0``) to answer "no native bf16" whatever the CPU: to try the
#: float32 default, or a benchmark's skip, on a CPU that has native bf16.
NO_NATIVE_BF16_ENV = "TOPK_DISTILL_ASSUME_NO_NATIVE_BF16"

#: Names of the half-precision dtypes (vLLM's and torch's spellings).
_HALF = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


class CpuDtype(NamedTuple):
    """The dtype to pass to the engine (``auto``: the engine's own choice), why, and
    whether the choice deserves a warning (half precision on a CPU that emulates it)."""

    dtype: str
    reason: str
    warn: bool = False


def resolve_cpu_dtype(
    requested: str, checkpoint: str | None, native_bf16: bool, capability: str = ""
) -> CpuDtype:
    """The dtype of a CPU engine for ``--dtype requested``.

    Args:
        requested: the ``--dtype`` flag's value (``auto`` or a dtype name).
        checkpoint: the checkpoint's dtype (``float32``, ``bfloat16``, ``float16``), or
            None when not known; only named in the reason.
        native_bf16: whether the CPU computes bf16 natively (:func:`cpu_has_native_bf16`).
        capability: the CPU's vector capability for the reason (``AVX2``, ...).
    """
    cpu = f" ({capability})" if capability else ""
    if requested.lower() != AUTO:
        half = _HALF.get(requested.lower())
        if half is not None and not native_bf16:
            return CpuDtype(
                requested,
                f"--dtype {requested} as given; this CPU has no native bf16{cpu}, so "
                f"{half} is emulated here: --dtype float32 (or auto) avoids that",
                warn=True,
            )
        return CpuDtype(requested, f"--dtype {requested} as given")
    if native_bf16:
        return CpuDtype(AUTO, f"--dtype auto: this CPU has native bf16{cpu}; the engine's choice")
    if checkpoint == "float32":
        why = "kept in float32 (not downcast to an emulated bf16)"
    elif checkpoint in _HALF:
        why = f"a {checkpoint} checkpoint upcast to float32 (exact; half precision is emulated)"
    else:
        why = f"a checkpoint of dtype {checkpoint or 'unknown'} run in float32"
    return CpuDtype("float32", f"--dtype auto: this CPU has no native bf16{cpu}: {why}")


def _assumed_without() -> bool:
    return os.environ.get(NO_NATIVE_BF16_ENV, "0") not in ("", "0")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively: AVX-512 BF16 or AMX on x86 (PyTorch's own
    query, the one vLLM uses). False when ``TOPK_DISTILL_ASSUME_NO_NATIVE_BF16`` is set;
    True on other architectures (not known here: the engine's rules apply)."""
    if _assumed_without():
        return False
    if platform.machine().lower() not in _X86:
        return True
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_capability() -> str:
    """PyTorch's name for this CPU's vector capability (``AVX2``, ``AVX512``, ...), and
    when ``TOPK_DISTILL_ASSUME_NO_NATIVE_BF16`` is set, that it is."""
    import torch

    name = str(torch.backends.cpu.get_cpu_capability())
    return f"{name}; {NO_NATIVE_BF16_ENV} is set" if _assumed_without() else name


def checkpoint_dtype(model: str | Path) -> str | None:
    """The dtype in a local checkpoint's ``config.json`` (``dtype`` or ``torch_dtype``, or
    its ``text_config``'s); None for a hub name or a config without one."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def cpu_dtype_for(requested: str, model: str | Path) -> CpuDtype:
    """:func:`resolve_cpu_dtype` for this CPU and the checkpoint at ``model``."""
    native = cpu_has_native_bf16()
    return resolve_cpu_dtype(requested, checkpoint_dtype(model), native, cpu_capability())
