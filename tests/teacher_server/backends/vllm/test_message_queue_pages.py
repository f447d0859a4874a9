"""Releasing the pages of vLLM's shared-memory message queues, on vLLM's own
``MessageQueue`` (one writer, one reader, in one process): the chunks every reader has
read go, the unread message stays whole, and the queue goes on working. Through a real
engine: ``tests/teacher_server/test_malloc_trim.py``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from teacher_server.backends.vllm import message_queue_pages
from teacher_server.backends.vllm.hooks import SIMULATE_VERSION_ENV
from teacher_server.backends.vllm.message_queue_pages import (
    release_message_queue_pages,
    release_read_chunks,
    ring_buffers,
)

CHUNK = 1 << 20
#: One message: 200,000 bytes of one value, pickled (about 49 pages of 4 KiB).
MESSAGE = 200_000


def _allocated(queue: MessageQueue) -> int:
    """Bytes of the queue's shared memory file that hold pages."""
    return os.stat(f"/dev/shm/{queue.buffer.shared_memory.name}").st_blocks * 512


@pytest.fixture
def queues() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    """A writer of 4 chunks of 1 MiB and its one reader, connected."""
    writer = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=writer.wait_until_ready)
    ready.start()
    reader.wait_until_ready()
    ready.join()
    yield writer, reader
    for q in (reader, writer):
        q.shutdown()


def test_read_chunks_are_released_and_the_unread_message_survives(queues) -> None:  # type: ignore[no-untyped-def]
    writer, reader = queues
    messages = [bytes([i]) * MESSAGE for i in range(1, 5)]
    for message in messages[:3]:
        writer.enqueue(message)
        assert reader.dequeue() == message
    writer.enqueue(messages[3])  # written, not read
    held = _allocated(writer)
    assert held >= 4 * MESSAGE  # four chunks touched

    given = release_read_chunks(writer.buffer)

    left = _allocated(writer)
    assert left == held - given
    assert MESSAGE <= left < 2 * MESSAGE  # the unread chunk's pages only
    assert given >= 3 * MESSAGE
    assert reader.dequeue() == messages[3]
    for message in messages:  # every chunk again, some of them punched before
        writer.enqueue(message)
        assert reader.dequeue() == message
    assert release_read_chunks(writer.buffer) >= 3 * MESSAGE


def test_nothing_is_released_while_a_chunk_is_unread_or_never_written(queues) -> None:  # type: ignore[no-untyped-def]
    writer, reader = queues
    writer.enqueue(b"x" * MESSAGE)
    assert release_read_chunks(writer.buffer) == 0
    assert reader.dequeue() == b"x" * MESSAGE
    assert release_read_chunks(writer.buffer) > 0
    assert release_read_chunks(writer.buffer) == 0  # nothing left to give


def test_the_process_s_queues_are_found_and_released_together(queues) -> None:  # type: ignore[no-untyped-def]
    """Both ends map the same file: the scan finds both ring buffer objects; the file's
    pages go once."""
    writer, reader = queues
    assert {id(writer.buffer), id(reader.buffer)} <= {id(r) for r in ring_buffers()}
    writer.enqueue(b"y" * MESSAGE)
    assert reader.dequeue() == b"y" * MESSAGE
    held = _allocated(writer)
    assert release_message_queue_pages() >= held - _allocated(writer) >= MESSAGE


def test_another_vllm_release_releases_nothing(queues, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The hook's fallback: under a vLLM release the layout was not checked for, the read
    chunks keep their pages, and one warning names the hook."""
    writer, reader = queues
    writer.enqueue(b"z" * MESSAGE)
    assert reader.dequeue() == b"z" * MESSAGE
    held = _allocated(writer)
    monkeypatch.setenv(SIMULATE_VERSION_ENV, "0.99.0")
    message_queue_pages._layout_checked.cache_clear()
    try:
        assert release_message_queue_pages() == 0
        assert release_message_queue_pages() == 0
    finally:
        message_queue_pages._layout_checked.cache_clear()
    assert _allocated(writer) == held
    warnings = [r for r in caplog.records if "message_queue_pages fell back" in r.getMessage()]
    assert len(warnings) == 1
