"""Give memory that glibc's allocator holds freed back to the OS: ``malloc_trim(0)``.

glibc keeps what a process frees for its next allocations: its heap only shrinks from
the top, and blocks below the dynamic mmap threshold (which rises to the largest block
freed so far, up to 32 MiB) come from that heap. A process whose peak moves up once (a
larger batch than any before) keeps the new high-water mark resident although it is
free. That was the soak's only growth: one step of 17 MiB within 30 s in the ``[heap]``
of vLLM's processes, flat before and after (docs/operations.md, memory over time).
``malloc_trim(0)`` hands every whole free page of every arena back (``madvise``).

Under steady load that memory is the engine's working set: a soak that trimmed every 30 s
saw each trim give back about 270 MiB of vLLM's worker process, taken again within 10 s
(re-faulted page by page). So the server trims only once it has been quiet (at most one
request holding an admission slot: one client's sequential calls, no burst) for
``--memory-trim-idle-s``, once per quiet spell (:func:`trim_when_quiet`), and once more
after a client that went leaving answers unsent (a killed slow reader starts a new
spell): after a burst, a storm of clients, slow readers killed or a day's training, the
memory goes back to the machine, also while a light client keeps calling; under load
nothing is trimmed and nothing re-faulted.
It trims its own process and, through the backend, vLLM's worker processes (the worker
extension's method, run between engine steps; on CPU the one worker is a child of vLLM's
engine-core process, which schedules and is not trimmed).

Written here rather than set through glibc's tunables
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``):
those return freed memory at every ``free``, which is the re-faulting above on every
engine step. glibc only: with another C library (or an allocator preloaded in its
place) the call changes nothing and reports 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

__all__ = ["DEFAULT_MEMORY_TRIM_IDLE_S", "malloc_trim", "trim_when_quiet"]

log = logging.getLogger(__name__)

#: Default ``--memory-trim-idle-s``: seconds of idleness before the trim.
DEFAULT_MEMORY_TRIM_IDLE_S = 10.0


@cache
def _libc_malloc_trim() -> Any:
    """glibc's ``int malloc_trim(size_t pad)``, or None where the C library has none."""
    fn = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _rss_bytes() -> int:
    """This process's resident set, bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def malloc_trim() -> int:
    """``malloc_trim(0)`` in this process; returns the resident bytes it gave back
    (0 without glibc). Thread-safe (glibc locks each arena while it trims it)."""
    fn = _libc_malloc_trim()
    if fn is None:
        return 0
    before = _rss_bytes()
    fn(0)
    return max(before - _rss_bytes(), 0)


async def trim_when_quiet(
    quiet_s: float,
    quiet_since: Callable[[], float | None],
    engine_trim: Callable[[], Awaitable[int]],
    on_trim: Callable[[str, int], None],
    drop_caches: Callable[[], None] | None = None,
) -> None:
    """Once per quiet spell, when it has lasted ``quiet_s``: call ``drop_caches`` (the
    backend's caches of answers, kept for requests that arrive together), trim this
    process (in a worker thread: the loop keeps serving) and await ``engine_trim`` (the
    backend's engine processes); ``on_trim(process, bytes_given_back)`` after each,
    ``process`` being ``"server"`` or ``"engine"``. ``quiet_since()``: ``time.monotonic()``
    when the current quiet spell began (:attr:`AdmissionQueue.quiet_since
    <teacher_server.admission.AdmissionQueue.quiet_since>`: at most one request in
    flight; a client that went leaving answers unsent starts a new spell), ``None`` while
    the server is busier. Runs until cancelled; a failed engine trim is logged (once per
    run of failures) and tried again at the next quiet spell."""
    trimmed: float | None = None  # the start of the quiet spell trimmed last
    failed = False
    while True:
        await asyncio.sleep(min(quiet_s, 1.0))
        since = quiet_since()
        if since is None or since == trimmed or time.monotonic() - since < quiet_s:
            continue
        trimmed = since
        if drop_caches is not None:
            drop_caches()
        on_trim("server", await asyncio.to_thread(malloc_trim))
        try:
            on_trim("engine", await engine_trim())
            failed = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not failed:
                log.warning("engine memory trim failed: %s: %s", type(exc).__name__, exc)
            failed = True
