"""Bases for objects that hold a resource until ``close()``: ``with`` / ``async with`` closes it."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["AsyncCloseable", "Closeable"]


class Closeable(abc.ABC):
    """``__enter__`` returns the object; ``__exit__`` calls :meth:`close`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the resource (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncCloseable(abc.ABC):
    """``async with obj: ...`` closes it: ``__aenter__`` returns the object, ``__aexit__``
    awaits :meth:`close`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the resource (idempotent)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
