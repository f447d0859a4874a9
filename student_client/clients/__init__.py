"""The teacher clients: the asyncio core (:mod:`.aio`), its blocking facade
(:mod:`.blocking`), several teachers routed per sequence (:mod:`.multi`, :mod:`.routing`),
and the interface they all satisfy (:mod:`.protocol`)."""
