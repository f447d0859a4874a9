"""The memory trim: glibc gives freed heap pages back; the server trims when quiet."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import platform
import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import psutil
import pytest

from devtools.launch import TeacherProcess
from teacher_server.admission import AdmissionQueue
from teacher_server.config import ServerConfig
from teacher_server.malloc_trim import DEFAULT_MEMORY_TRIM_IDLE_S, malloc_trim, trim_when_quiet
from topk_protocol import build_request, pb_grpc

MIB = 1024 * 1024

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc_only
def test_malloc_trim_gives_back_freed_heap_memory_that_glibc_keeps() -> None:
    """96 MiB of 64 KiB blocks (below the mmap threshold: glibc's heap), touched, then
    freed but for the last one, which pins the heap's top: glibc keeps the rest resident
    (it trims only from the top) until malloc_trim hands the free pages back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 64 * 1024
    blocks = [libc.malloc(block) for _ in range(96 * MIB // block)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, block)
    for b in blocks[:-1]:
        libc.free(b)
    try:
        given = malloc_trim()
    finally:
        libc.free(blocks[-1])
    assert given >= 64 * MIB, f"malloc_trim gave back {given / MIB:.1f} MiB of ~96 MiB free"
    assert malloc_trim() < 16 * MIB  # nothing much left to give right after


def test_trim_when_quiet_trims_once_per_quiet_spell_and_survives_an_engine_failure() -> None:
    """Busy: no trim. Quiet for 0.2 s: the backend's caches dropped, then one trim of each
    process. Still quiet: no more. A new quiet spell: again (its engine trim fails: logged,
    the loop goes on), and again."""
    calls: list[tuple[str, int]] = []
    engine_answers: Iterator[int | Exception] = iter([7, RuntimeError("engine gone"), 9])
    state: dict[str, float | None] = {"since": None}

    async def engine_trim() -> int:
        answer = next(engine_answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main() -> None:
        task = asyncio.create_task(
            trim_when_quiet(
                0.2,
                lambda: state["since"],
                engine_trim,
                lambda p, n: calls.append((p, n)),
                lambda: calls.append(("caches dropped", 0)),
            )
        )
        await asyncio.sleep(0.5)
        assert calls == []  # busy all along
        for spell in range(3):
            state["since"] = time.monotonic()
            while sum(p == "server" for p, _ in calls) <= spell:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the same spell goes on: nothing more
            assert sum(p == "server" for p, _ in calls) == spell + 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 20))
    assert [n for p, n in calls if p == "engine"] == [7, 9]  # the failed one reports nothing
    # Each spell: the backend's caches dropped first, then the server trimmed.
    spells = [p for p, _ in calls if p != "engine"]
    assert spells == ["caches dropped", "server"] * 3
    assert all(n >= 0 for _, n in calls)


def test_admission_says_since_when_it_is_idle() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, 1)
        made = q.idle_since
        assert made is not None and made <= time.monotonic()
        await q.acquire()
        assert q.idle_since is None
        q.release()
        assert q.idle_since is not None and q.idle_since >= made

    asyncio.run(main())


def test_admission_says_since_when_it_is_quiet_and_a_release_starts_a_new_spell() -> None:
    """Quiet: at most one request in flight (a lone client's calls do not end the spell);
    two end it; a client that went leaving answers unsent starts a new one, while quiet
    only."""

    async def main() -> None:
        q = AdmissionQueue(4, 4)
        made = q.quiet_since
        assert made is not None
        await q.acquire()
        assert q.quiet_since == made  # one request in flight: still the same quiet spell
        await q.acquire()
        assert q.quiet_since is None  # two: busy
        q.restart_quiet_spell()
        assert q.quiet_since is None  # not quiet: nothing to restart
        q.release()
        again = q.quiet_since
        assert again is not None and again >= made
        while time.monotonic() == again:
            await asyncio.sleep(0)
        q.restart_quiet_spell()
        assert q.quiet_since is not None and q.quiet_since > again
        q.release()

    asyncio.run(main())


def test_memory_trim_idle_s_is_checked_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^memory_trim_idle_s: must be >= 0, got -1"):
        ServerConfig(memory_trim_idle_s=-1)


def _engine_trimmed_bytes(http: str) -> float:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    found = re.search(
        r'^topk_teacher_memory_trimmed_bytes_total\{process="engine"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def _engine_rss(server_pid: int) -> int:
    """RSS of vLLM's worker process (the model, the KV cache): the server's largest
    descendant."""
    children = psutil.Process(server_pid).children(recursive=True)
    return max(int(c.memory_info().rss) for c in children)


#: Bursts of the leak guard; growth is measured from each to the next.
BURSTS = 4
#: The server process, once trimmed, grows by at most this from some burst to the next.
#: Without a leak it moved by -2.8 to +2.8 MiB per burst; a leak of 4 MiB per request (12
#: MiB per burst, half of each answer kept) or more fails it.
SERVER_GROWTH_BOUND = 8 * MIB
#: The same for vLLM's worker process: it settles over its first few bursts (up to +18.5
#: MiB per burst, then 0 to +7.2), so this one is coarser: a leak of one burst's answers
#: (24 MiB) per burst fails it.
ENGINE_GROWTH_BOUND = 24 * MIB


@pytest.mark.vllm
@glibc_only
def test_an_idle_teacher_gives_memory_back_and_keeps_none_per_request(
    vllm_teacher: TeacherProcess,
) -> None:
    """The same burst of large requests (4 answers of 8 MiB, two at a time: the server is
    busy, not quiet) ``BURSTS`` times. After each, once the server has been quiet for
    ``--memory-trim-idle-s``, it trims: ``/metrics``
    counts what came back and the worker's RSS falls by about as much. What is resident
    then (freed memory given back) is what the processes keep: a leak that grows with the
    work grows it after every burst, so from at least one burst to the next it must grow
    by at most ``SERVER_GROWTH_BOUND`` (the server process) and ``ENGINE_GROWTH_BOUND``
    (vLLM's worker). Shown to fail on an injected leak of 8 MiB per request
    (``teacher_server.leak_injection``; the session's server inherits the variable)::

        TOPK_DISTILL_INJECT_LEAK_MIB=8 python -m pytest -m vllm \\
            tests/teacher_server/test_malloc_trim.py

    The slow-leak measure is the soak benchmark (docs/operations.md)."""
    server = vllm_teacher
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, 2048).astype(np.int32) for _ in range(8)]
    rounds = []
    opts = [("grpc.max_receive_message_length", 64 * MIB)]  # one answer is 8 MiB
    with grpc.insecure_channel(server.target, options=opts) as ch:
        stub = pb_grpc.TeacherStub(ch)
        request = build_request(seqs, 64, dtype="float32")
        for _ in range(BURSTS):
            trimmed0 = _engine_trimmed_bytes(server.http)
            with ThreadPoolExecutor(2) as pool:  # two in flight: not a quiet spell
                list(pool.map(lambda _: stub.Score(request, timeout=300), range(4)))
            busy = _engine_rss(server.proc.pid)
            deadline = time.monotonic() + DEFAULT_MEMORY_TRIM_IDLE_S + 30  # a stop, if none
            while _engine_trimmed_bytes(server.http) == trimmed0 and time.monotonic() < deadline:
                time.sleep(0.5)
            given = _engine_trimmed_bytes(server.http) - trimmed0
            # The server process trims before the engine's: both are done now.
            kept = int(psutil.Process(server.proc.pid).memory_info().rss)
            rounds.append((busy, given, _engine_rss(server.proc.pid), kept))
    for busy, given, idle, kept in rounds:
        print(
            f"engine RSS {busy / MIB:.1f} MiB after the burst, {idle / MIB:.1f} MiB once "
            f"quiet (the trim gave back {given / MIB:.1f} MiB); server {kept / MIB:.1f} MiB"
        )
        assert given >= 16 * MIB
        assert idle <= busy - given / 2
    # The engine core trimmed too: vLLM loaded this project's plugin in it.
    assert "engine core's memory is not trimmed" not in server.log()
    for name, column, bound in (
        ("server", 3, SERVER_GROWTH_BOUND),
        ("engine", 2, ENGINE_GROWTH_BOUND),
    ):
        growth = [b[column] - a[column] for a, b in itertools.pairwise(rounds)]
        shown = ", ".join(f"{g / MIB:+.1f}" for g in growth)
        assert min(growth) <= bound, (
            f"the {name} process kept memory after every burst: {shown} MiB once idle "
            f"(at most {bound / MIB:.0f} MiB from some burst to the next)"
        )
