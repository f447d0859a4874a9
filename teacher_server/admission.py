"""Bounded admission: at most ``max_inflight`` requests work at once, at most
``max_queued`` more wait for a slot, the rest are refused. Waiters get a freed slot in
turn per client and stream (:mod:`teacher_server.fair_share`), not first come first
served.

Plain asyncio, no gRPC: the request pipeline turns :class:`AdmissionRefused` into a
retryable ``UNAVAILABLE``. Written here rather than with ``asyncio.Semaphore`` because
the queue must be bounded (a semaphore lets any number wait) and must refuse every
waiter at once when draining starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable

from teacher_server.fair_share import FairQueue

__all__ = ["QUIET_IN_FLIGHT", "AdmissionQueue", "AdmissionRefused"]

#: The server is *quiet* while at most this many requests hold a slot: one client's
#: sequential calls (a canary, a trainer at depth 1), no burst. What waits for a quiet
#: spell (the memory trim, :mod:`teacher_server.malloc_trim`) runs under such a load too.
QUIET_IN_FLIGHT = 1


class AdmissionRefused(Exception):
    """No slot: the queue is full, or it was closed (draining). ``message`` says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AdmissionQueue:
    """``await acquire()`` before the work, ``release()`` after it (also on failure).

    Args:
        max_inflight: requests working at once (``--max-inflight-requests``), >= 1.
        max_queued: requests waiting for a slot (``--max-queued-requests``), >= 0.
        on_change: called with ``(in_flight, queued)`` after every change (metrics).
        fair: waiters served in turn per ``(client, stream)`` (default); False: in
            arrival order (``--admission-order arrival``).
    """

    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        on_change: Callable[[int, int], None] | None = None,
        fair: bool = True,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight_requests: must be >= 1, got {max_inflight}")
        if max_queued < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {max_queued}")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self._on_change = on_change
        self._in_flight = 0
        self._waiters: FairQueue[asyncio.Future[None]] = FairQueue(fair)
        self._closed: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._idle_since: float | None = time.monotonic()
        self._quiet_since: float | None = self._idle_since

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def idle_since(self) -> float | None:
        """``time.monotonic()`` when the last request let go of its slot (or when the
        queue was made), ``None`` while a request holds one."""
        return self._idle_since

    @property
    def quiet_since(self) -> float | None:
        """``time.monotonic()`` when the current quiet spell began (at most
        :data:`QUIET_IN_FLIGHT` requests holding a slot since), ``None`` while more hold
        one."""
        return self._quiet_since

    def restart_quiet_spell(self) -> None:
        """Memory was let go (a client went, leaving answers unsent): while quiet, a new
        quiet spell starts now, so what runs once per spell runs again."""
        if self._quiet_since is not None:
            self._quiet_since = time.monotonic()

    def _changed(self) -> None:
        if self._in_flight <= QUIET_IN_FLIGHT:
            if self._quiet_since is None:
                self._quiet_since = time.monotonic()
        else:
            self._quiet_since = None
        if self._in_flight:
            self._idle.clear()
            self._idle_since = None
        else:
            self._idle.set()
            if self._idle_since is None:
                self._idle_since = time.monotonic()
        if self._on_change is not None:
            self._on_change(self._in_flight, len(self._waiters))

    async def acquire(self, client: Hashable = None, stream: Hashable = None) -> None:
        """Take a slot, waiting for its turn when all are busy; raise
        :class:`AdmissionRefused` when the line is full or the queue is closed.
        ``client``/``stream`` name whose turn it is (``None`` stream: a stream of its
        own, as a unary call is)."""
        if self._closed is not None:
            raise AdmissionRefused(self._closed)
        if self._in_flight < self.max_inflight and not self._waiters:
            self._in_flight += 1
            self._changed()
            return
        if len(self._waiters) >= self.max_queued:
            raise AdmissionRefused(
                f"requests: {self._in_flight} in flight and {len(self._waiters)} queued reach "
                f"max_inflight_requests {self.max_inflight} + max_queued_requests "
                f"{self.max_queued}; the teacher is overloaded, retry later"
            )
        waiter = asyncio.get_running_loop().create_future()
        if stream is None:
            stream = waiter
        self._waiters.push(client, stream, waiter)
        self._changed()
        try:
            await waiter  # release() hands its slot over (in_flight already counted)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # the slot came just as the caller gave up: pass it on
            elif self._waiters.remove(client, stream, waiter):
                self._changed()
            raise

    def release(self) -> None:
        """Give the slot back: to the next waiter in turn, if any."""
        self._in_flight -= 1
        while self._waiters:
            waiter = self._waiters.pop()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)
                break
        self._changed()

    def close(self, message: str) -> None:
        """Refuse every waiter and every later :meth:`acquire` with ``message``; requests
        holding a slot keep it."""
        self._closed = message
        while self._waiters:
            waiter = self._waiters.pop()
            if not waiter.done():
                waiter.set_exception(AdmissionRefused(message))
        self._changed()

    async def wait_idle(self) -> None:
        """Return once no request holds a slot."""
        await self._idle.wait()
