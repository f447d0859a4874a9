"""The teacher process's lifecycle state: the one place that says whether it serves.

``STARTING`` (ports open, engine loading and warming up) -> ``READY`` -> ``DRAINING``
(SIGTERM: finish what is in flight, refuse the rest). ``FAILED``: the engine did not
start. The servicer, the HTTP app (``/readyz``) and the gRPC health service all read or
follow this object; nothing else keeps a copy of the state.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "ENGINE_SHUTDOWN_S",
    "SHUTDOWN_MARGIN_S",
    "Lifecycle",
    "Phase",
]

#: Default of ``--drain-timeout-s``: the whole shutdown's budget for requests in flight.
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: What the process needs after the drain budget to exit (closing the HTTP server and
#: the engine). An orchestrator's grace period before SIGKILL must cover a pre-stop
#: delay + the drain timeout + this; tests/test_deploy.py checks the manifests.
SHUTDOWN_MARGIN_S = 5.0
#: Of that margin, what the engine gets to stop before its processes are killed.
ENGINE_SHUTDOWN_S = 2.0


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


#: Why a request is refused in each phase but READY (the gRPC status is UNAVAILABLE:
#: the client retries, elsewhere when it has other targets).
_REFUSALS = {
    Phase.STARTING: "teacher: still loading; retry later",
    Phase.DRAINING: "teacher: shutting down; retry elsewhere",
    Phase.FAILED: "teacher: the engine failed to start; retry elsewhere",
}


class Lifecycle:
    """Current :class:`Phase` plus the listeners told about every change (in order).

    Transitions only move forward: READY after STARTING, DRAINING from any phase, FAILED
    from STARTING; anything else is ignored (e.g. READY arriving after SIGTERM).
    """

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._listeners: list[Callable[[Phase], Awaitable[None]]] = []

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def ready(self) -> bool:
        return self._phase is Phase.READY

    def refusal(self) -> str | None:
        """``None`` when requests are admitted, else the message to refuse them with."""
        return _REFUSALS.get(self._phase)

    def subscribe(self, listener: Callable[[Phase], Awaitable[None]]) -> None:
        """``await listener(phase)`` on every transition from now on."""
        self._listeners.append(listener)

    async def advance(self, phase: Phase) -> bool:
        """Move to ``phase`` if allowed; True when the phase changed."""
        allowed = {
            Phase.READY: self._phase is Phase.STARTING,
            Phase.FAILED: self._phase is Phase.STARTING,
            Phase.DRAINING: self._phase is not Phase.DRAINING,
            Phase.STARTING: False,
        }[phase]
        if not allowed:
            return False
        self._phase = phase
        for listener in self._listeners:
            await listener(phase)
        return True
