"""A base for objects that hold a resource until ``close()``: ``with obj: ...`` closes it."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["Closeable"]


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
