"""Every client satisfies the one client interface (``student_client.clients.sources``):
the blocking ones ``TeacherSource``, the asyncio ones ``AsyncTeacherSource``; ``names``
tells one teacher (``[]``) from several. mypy checks the signatures
(``student_client/offline/conformance.py``); this checks the objects users get at run time, and
that the Trainer refuses what is not a client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from recording_fakes import INFO, K, teacher_answer

from student_client import (
    AsyncMultiTeacherClient,
    AsyncTeacherClient,
    AsyncTeacherSource,
    MultiReplayClient,
    MultiTeacherClient,
    ReplayClient,
    TeacherClient,
    TeacherSource,
)
from topk_protocol.recording import RecordingWriter
from topk_protocol.recording.multi_recording import teacher_recording_path, write_manifest

# Nothing listens here: the clients connect lazily, at the first call.
NOWHERE = "127.0.0.1:9"


def _recording(root: Path) -> Path:
    with RecordingWriter(root, INFO) as w:
        tokens, answer = teacher_answer(7, 0)
        w.add(tokens, answer, dtype="float32")
    return root


def _multi_recording(root: Path) -> Path:
    for name in ("a", "b"):
        _recording(teacher_recording_path(root, name))
    write_manifest(root, ["a", "b"])
    return root


def test_blocking_clients_are_teacher_sources(tmp_path: Path) -> None:
    clients = [
        TeacherClient(NOWHERE),
        MultiTeacherClient({"a": NOWHERE, "b": NOWHERE}),
        ReplayClient(_recording(tmp_path / "one")),
        MultiReplayClient(_multi_recording(tmp_path / "many")),
    ]
    try:
        for client in clients:
            assert isinstance(client, TeacherSource), type(client).__name__
        assert [c.names for c in clients] == [[], ["a", "b"], [], ["a", "b"]]
        payload = clients[2].score([teacher_answer(7, 0)[0]], K)  # one call through it
        assert payload.ids.shape == (1, 7, K)
    finally:
        for client in clients:
            client.close()


def test_async_clients_are_async_teacher_sources() -> None:
    async def check() -> None:
        single = AsyncTeacherClient(NOWHERE)
        multi = AsyncMultiTeacherClient({"a": NOWHERE})
        try:
            assert isinstance(single, AsyncTeacherSource)
            assert isinstance(multi, AsyncTeacherSource)
            assert single.names == [] and multi.names == ["a"]
        finally:
            await single.close()
            await multi.close()

    asyncio.run(check())


def test_a_plain_object_is_not_a_source() -> None:
    class StreamOnly:
        def stream(self, batches: object, top_k: int) -> list[object]:
            return []

    assert not isinstance(StreamOnly(), TeacherSource)
    pytest.importorskip("transformers")
    from student_client.integrations.hf_trainer import TopKDistillationTrainer

    with pytest.raises(TypeError, match="teacher: expected a target string"):
        TopKDistillationTrainer(teacher=StreamOnly())  # type: ignore[arg-type]
