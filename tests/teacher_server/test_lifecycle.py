"""The lifecycle state: forward-only transitions, listeners, refusal messages."""

from __future__ import annotations

import asyncio

from teacher_server.lifecycle import Lifecycle, Phase


def test_transitions_and_listeners() -> None:
    async def main() -> None:
        seen: list[Phase] = []
        lc = Lifecycle()

        async def listen(phase: Phase) -> None:
            seen.append(phase)

        lc.subscribe(listen)
        assert lc.phase is Phase.STARTING and not lc.ready
        assert "loading" in (lc.refusal() or "")
        assert await lc.advance(Phase.READY)
        assert lc.ready and lc.refusal() is None
        assert not await lc.advance(Phase.FAILED)  # only from STARTING
        assert await lc.advance(Phase.DRAINING)
        assert "shutting down" in (lc.refusal() or "")
        assert not await lc.advance(Phase.READY)  # never back
        assert not await lc.advance(Phase.DRAINING)
        assert seen == [Phase.READY, Phase.DRAINING]

    asyncio.run(main())


def test_sigterm_while_loading_stays_draining() -> None:
    async def main() -> None:
        lc = Lifecycle()
        assert await lc.advance(Phase.DRAINING)
        assert not await lc.advance(Phase.READY)  # the engine finished loading too late
        assert lc.phase is Phase.DRAINING

    asyncio.run(main())
