"""Per-stream backpressure: how much a ``ScoreStream`` may hold that its client has not
read yet.

One :class:`StreamBudget` per stream. The stream's reader takes a request slot
(:meth:`StreamBudget.take_request`) before it reads the next request from the client, and
each request reserves the bytes of its answer (:meth:`StreamBudget.take_bytes`, known
from the validated request) before it is scored; both come back when the request's last
answer message has been handed to gRPC (:meth:`StreamBudget.give_back`). gRPC hands a
message over only as HTTP/2 flow control lets it go, so a client that stops reading
soon stops its stream: no more requests are read from it (gRPC's flow control then holds
its sends), nothing more of it is scored, and at most ``max_unsent_bytes`` of answers
(plus one request's when that one alone is larger) wait in memory for it. Other streams
are not delayed: a waiting stream holds no admission slot and no engine work.

Plain asyncio (a :class:`asyncio.Condition`), no gRPC: written here because the wait is
on two quantities at once (requests and bytes), which ``asyncio.Semaphore`` cannot do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# The defaults are the server settings' (written once, in teacher_server.config).
from teacher_server.config import DEFAULT_STREAM_MAX_UNSENT_MB, DEFAULT_STREAM_MAX_UNSENT_REQUESTS

__all__ = [
    "DEFAULT_STREAM_MAX_UNSENT_MB",
    "DEFAULT_STREAM_MAX_UNSENT_REQUESTS",
    "StreamBudget",
]


class StreamBudget:
    """The unsent work of one stream: at most ``max_requests`` requests and
    ``max_bytes`` bytes of answers (one request may exceed the bytes alone).

    Args:
        max_requests: >= 1.
        max_bytes: >= 1.
        on_bytes: called with each change of :attr:`bytes` (``+n`` reserved, ``-n``
            given back): the server's gauge of unsent bytes.
    """

    def __init__(
        self, max_requests: int, max_bytes: int, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"stream_max_unsent_requests: must be >= 1, got {max_requests}")
        if max_bytes < 1:
            raise ValueError(f"stream_max_unsent_bytes: must be >= 1, got {max_bytes}")
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0
        self._on_bytes = on_bytes
        self._changed = asyncio.Condition()

    async def take_request(self) -> None:
        """Wait until the stream may read one more request, and count it."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.requests < self.max_requests)
            self.requests += 1

    async def take_bytes(self, n: int) -> None:
        """Wait until ``n`` more bytes of answers fit (or nothing else is unsent)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.bytes == 0 or self.bytes + n <= self.max_bytes
            )
            self.bytes += n
            if self._on_bytes is not None:
                self._on_bytes(n)

    async def give_back(self, n: int) -> None:
        """A request is answered (or failed): its slot and its ``n`` bytes return."""
        async with self._changed:
            self.requests -= 1
            self.bytes -= n
            if self._on_bytes is not None:
                self._on_bytes(-n)
            self._changed.notify_all()
