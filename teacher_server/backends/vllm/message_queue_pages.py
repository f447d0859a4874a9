"""Give back the pages of vLLM's shared-memory message queues that hold no unread message.

vLLM's multiprocess executor (which its CPU build always uses, even for one worker) talks
to its worker through two ring buffers in ``/dev/shm``
(``vllm.distributed.device_communicators.shm_broadcast.ShmRingBuffer``): the engine core
broadcasts each step's scheduler output (10 chunks of ``VLLM_MQ_MAX_CHUNK_BYTES_MB``,
16 MiB), and the worker answers with the model runner's output, the step's prompt
log-probs included (10 chunks of 24 MiB). A message is written at the start of its chunk
(a larger one goes over a socket instead), and a page of shared memory, once written,
stays resident for the life of the engine, in both processes that map it: each chunk's
resident size is the largest message it ever held. A teacher that served one large batch
keeps up to 240 + 160 MiB of them (counted in both processes' RSS), and one that serves
ever larger batches grows towards that, one chunk at a time, in no relation to what it
holds now.

:func:`release_read_chunks` punches the data pages of every chunk that every reader has
read (``madvise(MADV_REMOVE)`` on the shared mapping: the file's pages go, in every process
that maps it; a later write faults fresh zeroed pages in). Each chunk's metadata bytes say
its state (vLLM's ring buffer protocol: the written flag, then one flag per reader; all
ones is a message read by everyone, which the writer may overwrite but no reader reads
again); the metadata pages are never touched.

Safe only where no writer is writing: the worker extension calls it from a
``collective_rpc`` handler, between engine steps, where the engine core waits for the
worker's answer (it writes nothing to the broadcast queue) and the worker's own thread,
the handler's, is the response queue's only writer. The queues are found as the live
``ShmRingBuffer`` objects of the process (:func:`ring_buffers`: vLLM keeps them on its
worker process object, which the extension has no reference to), by one scan of the
garbage collector's objects (under 0.1 s here), remembered weakly for the next calls.
"""

from __future__ import annotations

import functools
import gc
import logging
import mmap
import os
import weakref
from typing import Any

from teacher_server.backends.vllm.hooks import MESSAGE_QUEUE_PAGES, report, version_problem

__all__ = ["release_message_queue_pages", "release_read_chunks", "ring_buffers"]

log = logging.getLogger(__name__)

#: The ring buffers found by the last scan, while they live.
_found: weakref.WeakSet[Any] = weakref.WeakSet()


@functools.cache
def _layout_checked() -> bool:
    """Whether the installed vLLM is one the ring buffer's layout was checked for (the
    hook's start-up line, once)."""
    problem = version_problem(MESSAGE_QUEUE_PAGES)
    report(MESSAGE_QUEUE_PAGES, problem)
    return problem is None


def ring_buffers() -> list[Any]:
    """The ``ShmRingBuffer`` objects alive in this process whose shared memory is mapped
    here ([] where vLLM is not installed). Scans the garbage collector's objects when
    none found before is still mapped."""
    live = [ring for ring in _found if _mapped(ring)]
    if live:
        return live
    try:
        from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
    except ImportError:
        return []
    # type(), not isinstance(): the latter reads ``__class__``, which some lazy module
    # objects answer with a deprecation warning.
    for obj in gc.get_objects():
        if issubclass(type(obj), ShmRingBuffer):
            _found.add(obj)
    return [ring for ring in _found if _mapped(ring)]


def _mapped(ring: Any) -> bool:
    """Whether the ring buffer's shared memory is open in this process."""
    shm = getattr(ring, "shared_memory", None)
    return shm is not None and shm.buf is not None


def _allocated_bytes(fd: int) -> int:
    """Bytes of the shared memory file that hold pages (tmpfs counts each page once,
    whatever number of processes maps it)."""
    return os.fstat(fd).st_blocks * 512


def release_read_chunks(ring: Any) -> int:
    """Punch the data pages of every chunk of ``ring`` (a ``ShmRingBuffer``) whose
    metadata says written and read by every reader; returns the bytes of shared memory
    given back (0 where the mapping cannot be reached)."""
    shm = ring.shared_memory
    mapping = getattr(shm, "_mmap", None)
    fd = getattr(shm, "_fd", -1)
    if mapping is None or fd < 0:
        return 0
    before = _allocated_bytes(fd)
    done = bytes([1]) * ring.metadata_size
    for index in range(ring.max_chunks):
        with ring.get_metadata(index) as flags:
            if bytes(flags) != done:
                continue
        start = ring.data_offset + index * ring.max_chunk_bytes
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (start + ring.max_chunk_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            mapping.madvise(mmap.MADV_REMOVE, first, end - first)
    return max(before - _allocated_bytes(fd), 0)


def release_message_queue_pages() -> int:
    """:func:`release_read_chunks` on every ring buffer of this process; the bytes of
    shared memory given back, summed. Nothing (0) under a vLLM release the ring buffer's
    layout was not checked for (:data:`~teacher_server.backends.vllm.hooks.MESSAGE_QUEUE_PAGES`,
    reported once). A failure is logged and counted as 0: this is a cleanup, never a
    reason for the engine step around it to fail."""
    if not _layout_checked():
        return 0
    total = 0
    for ring in ring_buffers():
        try:
            total += release_read_chunks(ring)
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("could not release a message queue's pages: %s", exc)
    return total
