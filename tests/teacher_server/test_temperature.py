"""Exact teacher temperature: ``--teacher-temperature T`` serves ``log_softmax(z / T)``.

One vLLM server per temperature (module scope, T = 0.5 then T = 2), each compared over
real gRPC with the transformers forward pass on the same float32 weights, tempered here
by hand; prompt rows, the last row and the sampled log-probs all carry the temperature.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server
from test_vllm_server import (
    TOL,
    _check_against_reference,
    _request,
    _sequences,
)

from devtools.tiny_model import TINY_SERVE_ARGS
from student_client.clients.blocking import TeacherClient
from student_client.offline.replay_client import ReplayClient
from teacher_server.backends.base import Backend, BackendInfo, topk_from_logprobs
from teacher_server.backends.replay_backend import ReplayBackend
from teacher_server.backends.transformers_backend import TransformersBackend
from teacher_server.grpc_api.servicer import teacher_info_message
from teacher_server.validation import Limits, ParsedSequence
from topk_protocol import RequestOptions, decode_sequence, pb, pb_grpc
from topk_protocol.errors import TeacherMismatchError, VocabMismatchError
from topk_protocol.recording import RecordingReader


def test_temperature_needs_the_worker_extension_slot(tmp_path: Path) -> None:
    """vLLM has one worker extension slot; T != 1 refuses an engine argument that takes it."""
    from teacher_server.backends.vllm.backend import VLLMBackend

    own = {"worker_extension_cls": "my.Extension"}
    with pytest.raises(ValueError, match=r"^worker_extension_cls: the teacher temperature"):
        VLLMBackend(tmp_path, temperature=2.0, engine_kwargs=own)
    VLLMBackend(tmp_path, temperature=1.0, engine_kwargs=own)  # T = 1 leaves it alone
    with pytest.raises(ValueError, match=r"^teacher_temperature: must be a finite number > 0"):
        VLLMBackend(tmp_path, temperature=0.0)


def test_info_always_carries_the_temperature() -> None:
    """A T = 1 teacher says so explicitly (the field has presence: unset is for teachers
    that predate it)."""
    for t in (1.0, 3.0):
        info = BackendInfo("m", 512, "fp", 64, temperature=t)
        msg = teacher_info_message(_Info(info), Limits(vocab_size=512))
        assert msg.HasField("teacher_temperature") and msg.teacher_temperature == t


@pytest.fixture(scope="module", params=[0.5, 2.0], ids=lambda t: f"T={t:g}")
def tempered_teacher(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[float, ServerProcess]]:
    """A vLLM teacher on the tiny model serving at temperature ``T`` (one at a time)."""
    t = float(request.param)
    log_path = tmp_path_factory.mktemp(f"vllm-teacher-T{t:g}") / "server.log"
    args = ["--backend", "vllm", "--model", str(tiny_model_dir), *TINY_SERVE_ARGS]
    server = start_server([*args, "--teacher-temperature", str(t)], log_path)
    yield t, server
    server.stop()


@pytest.fixture(scope="module")
def stub(tempered_teacher: tuple[float, ServerProcess]) -> Iterator[pb_grpc.TeacherStub]:
    opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(tempered_teacher[1].target, options=opts) as ch:
        yield pb_grpc.TeacherStub(ch)


class _Info(Backend):
    """A backend that only has an info (for ``teacher_info_message``)."""

    def __init__(self, info: BackendInfo) -> None:
        self.info = info

    async def score(self, *args: object) -> object:  # type: ignore[override]
        raise NotImplementedError


def _tempered_reference(model: torch.nn.Module, seq: np.ndarray, t: float) -> np.ndarray:
    """``log_softmax(logits / T)`` of the transformers forward pass, ``[L, V]`` float32."""
    with torch.inference_mode():
        logits = model(input_ids=torch.as_tensor(seq[None]).long()).logits[0]
        return torch.log_softmax(logits.float() / t, dim=-1).numpy()


@pytest.mark.vllm
def test_vllm_payload_is_tempered_reference(
    tempered_teacher: tuple[float, ServerProcess],
    stub: pb_grpc.TeacherStub,
    reference_backend: TransformersBackend,
) -> None:
    """Every row (prompt rows and the last one) and every sampled log-prob matches
    ``log_softmax(z / T)``: log-probs within 1e-4, ids where the rank is unambiguous at
    that drift."""
    t = tempered_teacher[0]
    k = 64
    seqs = _sequences(int(t * 10), [1, 2, 47, 300])
    resp = stub.Score(_request(seqs, k))
    for seq, payload in zip(seqs, resp.sequences, strict=True):
        got = decode_sequence(payload)
        dense = _tempered_reference(reference_backend._model, seq, t)
        ref = topk_from_logprobs(dense, seq, k + 1)  # one more column: see _check_against_reference
        _check_against_reference(got, ref)
        # The last row (vLLM's generated-token log-probs) on its own.
        np.testing.assert_allclose(got.logprobs[-1], ref.logprobs[-1, :k], atol=TOL, rtol=0)
        assert got.sampled_logprobs is not None
        np.testing.assert_allclose(
            got.sampled_logprobs[:-1], dense[np.arange(len(seq) - 1), seq[1:]], atol=TOL
        )
    # Tempering really changed the payload: T = 1 differs by far more than the tolerance.
    plain = torch.log_softmax(
        reference_backend._model(input_ids=torch.as_tensor(seqs[-1][None]).long())
        .logits[0]
        .detach()
        .float(),
        dim=-1,
    ).numpy()
    top1_plain = plain.max(axis=-1)
    assert np.abs(decode_sequence(resp.sequences[-1]).logprobs[:, 0] - top1_plain).max() > 0.05


@pytest.mark.vllm
def test_transformers_backend_applies_the_same_temperature(
    tempered_teacher: tuple[float, ServerProcess], tiny_model_dir: Path
) -> None:
    t = tempered_teacher[0]
    backend = TransformersBackend(tiny_model_dir, max_top_k=64, temperature=t)
    asyncio.run(backend.start())
    assert backend.info.temperature == t
    (seq,) = _sequences(5, [40])
    got = backend.score_sync(ParsedSequence(seq, 0, len(seq)), RequestOptions(16))
    model = backend._model
    dense = _tempered_reference(model, seq, t)
    want = topk_from_logprobs(dense, seq, 16)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


@pytest.mark.vllm
def test_info_announces_temperature(
    tempered_teacher: tuple[float, ServerProcess], stub: pb_grpc.TeacherStub
) -> None:
    t, server = tempered_teacher
    info = stub.GetInfo(pb.GetInfoRequest())
    assert info.HasField("teacher_temperature") and info.teacher_temperature == t
    with urllib.request.urlopen(f"{server.http}/v1/info", timeout=10) as r:
        assert json.loads(r.read())["teacher_temperature"] == t


@pytest.mark.vllm
def test_client_checks_expected_temperature(
    tempered_teacher: tuple[float, ServerProcess], tmp_path: Path
) -> None:
    """A client expecting another T is refused before its first request, naming the
    field; the right T is accepted; what it records keeps the temperature, and replay
    (client and server backend) announces and checks it."""
    t, server = tempered_teacher
    with (
        TeacherClient(server.target, expect_temperature=1.0, retries=0) as client,
        pytest.raises(TeacherMismatchError, match=r"teacher_temperature: .* T = 1\b") as err,
    ):
        client.score([[1, 2, 3]], top_k=4)
    assert not isinstance(err.value, VocabMismatchError)
    with (
        TeacherClient(server.target, expect_vocab_size=7, expect_temperature=1.0) as client,
        pytest.raises(VocabMismatchError, match=r"vocab_size.*teacher_temperature"),
    ):
        client.info()
    rec = tmp_path / "tempered-recording"
    with TeacherClient(server.target, expect_temperature=t, record_to=rec) as client:
        assert client.info().teacher_temperature == t
        live = client.score([[1, 2, 3, 4]], top_k=4)
    reader = RecordingReader(rec)
    try:  # the recording's metadata carries T (from GetInfo)
        assert reader.temperature == t and reader.metadata["temperature"] == t
    finally:
        reader.close()
    with ReplayClient(rec, expect_temperature=t) as replay:
        assert replay.info().teacher_temperature == t
        again = replay.score([[1, 2, 3, 4]], top_k=4)
        np.testing.assert_array_equal(again.logprobs, live.logprobs)
    with pytest.raises(TeacherMismatchError, match="teacher_temperature"):
        ReplayClient(rec, expect_temperature=1.0)
    backend = ReplayBackend(rec)
    asyncio.run(backend.start())
    try:
        msg = teacher_info_message(backend, Limits(vocab_size=512))
        assert msg.teacher_temperature == t
    finally:
        asyncio.run(backend.close())
