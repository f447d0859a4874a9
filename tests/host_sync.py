"""Test helper: a `TorchDispatchMode` that fails on every op making the host wait for the
device (`_local_scalar_dense` behind `.item()` / `float()` / `bool()`, `nonzero`,
`masked_select`, boolean-mask indexing, ...). Where CUDA is available it also sets CUDA's
own sync check (`torch.cuda.set_sync_debug_mode("error")`) while it is active, which
fails on every synchronizing CUDA call (a device-to-host copy, a blocking host-to-device
copy, a stream synchronize), whichever op makes it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoHostSync"]

aten = torch.ops.aten

_SYNCING = {
    aten._local_scalar_dense,
    aten.item,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten.unique_consecutive,
    aten._unique2,
}


def _is_bool_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


class NoHostSync(TorchDispatchMode):
    """Raises on any aten op that makes the host wait for a device value."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self._cuda_mode: int | None = None

    def __enter__(self) -> NoHostSync:
        if torch.cuda.is_available():
            self._cuda_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(self._cuda_mode)
            self._cuda_mode = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNCING:
            raise AssertionError(f"host sync: {func}")
        if packet in (aten.index, aten.index_put, aten.index_put_) and any(
            _is_bool_tensor(index) for index in (args[1] if len(args) > 1 else [])
        ):
            raise AssertionError(f"boolean-mask indexing: {func}")
        self.ops += 1
        return func(*args, **kwargs)
