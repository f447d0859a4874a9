"""What a benchmark needs of the machine, checked before it runs.

bf16 matmuls need a CPU that computes bf16 natively (AVX-512 BF16 or AMX; the rule and
its probe are the teacher's, ``teacher_server.backends.cpu_dtype``): elsewhere PyTorch
emulates bf16 and a bf16 benchmark runs far longer than on the CPUs it was sized for.
``TOPK_DISTILL_ASSUME_NO_NATIVE_BF16=1`` answers "no" on any CPU, to see a skip. (No
benchmark here needs a GPU.)
"""

from __future__ import annotations

from teacher_server.backends.cpu_dtype import cpu_capability, cpu_has_native_bf16

__all__ = ["bf16_skip_reason"]


def bf16_skip_reason() -> str | None:
    """None where this CPU computes bf16 natively; else ``skipped: this CPU has no native
    bf16 (AVX2)``, with PyTorch's name for the CPU's capability."""
    if cpu_has_native_bf16():
        return None
    return f"skipped: this CPU has no native bf16 ({cpu_capability()})"
