"""The order in which waiting requests get an admission slot: in turn, not first come
first served.

A waiting request belongs to a *stream* (a ``ScoreStream`` call; every unary ``Score``
or HTTP request is a stream of its own) and that stream to a *client* (who sent it:
:func:`client_identity`). :class:`FairQueue` hands out one request per client in
rotation, and within a client one per stream in rotation; within one stream requests
keep their order. So a stream with 100,000 requests behind it gets one turn in each
round like any other, and a client that just arrived waits for at most one admission
per other waiting client (and a new stream for at most one per other waiting stream of
its client) before its first request goes. Round robin by request, not by cost: a turn
is one request whatever its size (its bytes are bounded per stream by the stream's own
budget, :mod:`teacher_server.grpc_api.backpressure`).

:data:`ARRIVAL` order (``--admission-order arrival``) keeps every request in one line
in arrival order, first come first served, to compare against.

Pure Python, no asyncio: the admission queue (:mod:`teacher_server.admission`) keeps
its waiters here.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = [
    "ADMISSION_ORDERS",
    "ARRIVAL",
    "FAIR",
    "FairQueue",
    "client_identity",
]

T = TypeVar("T")

#: ``--admission-order`` values: in turn per client and stream (default), or arrival.
FAIR = "fair"
ARRIVAL = "arrival"
ADMISSION_ORDERS = (FAIR, ARRIVAL)


def client_identity(authorization: str | None, peer: str | None) -> str:
    """Who sent a request: its bearer token (as a short digest, never the token) and
    the host part of its network address (gRPC's ``"ipv4:10.0.0.7:51234"`` ->
    ``ipv4:10.0.0.7``).
    Clients sharing a token and a host (or behind one proxy) are one client; requests
    without either are all one anonymous client."""
    token = ""
    if authorization:
        token = hashlib.sha256(authorization.encode()).hexdigest()[:12]
    host = ""
    if peer:
        host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
    return f"{token}@{host}"


class FairQueue(Generic[T]):
    """Items waiting, taken in turn by ``(client, stream)``; ``fair=False``: in arrival
    order. ``len()`` counts the items; :meth:`pop` on an empty queue raises IndexError."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        # client -> stream -> items (FIFO); dicts keep the rotation order.
        self._clients: dict[Hashable, dict[Hashable, collections.deque[T]]] = {}
        self._arrival: collections.deque[T] = collections.deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, client: Hashable, stream: Hashable, item: T) -> None:
        """Queue ``item`` behind the earlier items of its stream; a client or stream with
        nothing waiting joins the end of its rotation."""
        self._len += 1
        if not self.fair:
            self._arrival.append(item)
            return
        streams = self._clients.setdefault(client, {})
        streams.setdefault(stream, collections.deque()).append(item)

    def pop(self) -> T:
        """The next item in turn (removed)."""
        if not self._len:
            raise IndexError("pop from an empty FairQueue")
        self._len -= 1
        if not self.fair:
            return self._arrival.popleft()
        client = next(iter(self._clients))
        streams = self._clients.pop(client)
        stream = next(iter(streams))
        items = streams.pop(stream)
        item = items.popleft()
        if items:  # the stream goes to the end of its client's rotation
            streams[stream] = items
        if streams:  # and the client to the end of the clients'
            self._clients[client] = streams
        return item

    def remove(self, client: Hashable, stream: Hashable, item: T) -> bool:
        """Take ``item`` out wherever it waits (its caller gave up); False if absent.
        The rotation order of the others does not change."""
        if not self.fair:
            try:
                self._arrival.remove(item)
            except ValueError:
                return False
            self._len -= 1
            return True
        streams = self._clients.get(client)
        items = None if streams is None else streams.get(stream)
        if streams is None or items is None or item not in items:
            return False
        items.remove(item)
        self._len -= 1
        if not items:
            del streams[stream]
        if not streams:
            del self._clients[client]
        return True

    def waiting_streams(self) -> int:
        """Streams with at least one item waiting (fair order only; else 0 or 1)."""
        if not self.fair:
            return int(bool(self._arrival))
        return sum(len(streams) for streams in self._clients.values())
