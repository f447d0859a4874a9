"""Packed payloads from the live vLLM teacher (the session's engine): they decode to within
the stated error bound of the same engine's float32 payload, ids exact (hypothesis over
K, lengths, bits, dtype); a packed recording of them replays byte-identically through
``ReplayClient``, ``PayloadDataset`` and ``teacher-server --backend replay``; bad packed
requests get errors naming the field and the limit, and the server keeps serving."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from recording_fakes import assert_bit_equal

from student_client.clients.blocking import TeacherClient
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay_client import ReplayClient
from topk_protocol import build_request, pb, pb_grpc
from topk_protocol.checks import MAX_LOGPROB_BITS, MIN_LOGPROB_BITS
from topk_protocol.errors import NotRecordedError
from topk_protocol.packing import error_bound

pytestmark = pytest.mark.vllm

VOCAB = 512  # the tiny model's


def _sequences(seed: int, lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


@pytest.fixture(scope="module")
def client(vllm_teacher: ServerProcess) -> Iterator[TeacherClient]:
    with TeacherClient(vllm_teacher.target) as c:
        yield c


@pytest.fixture(scope="module")
def stub(vllm_teacher: ServerProcess) -> Iterator[pb_grpc.TeacherStub]:
    with grpc.insecure_channel(vllm_teacher.target) as ch:
        yield pb_grpc.TeacherStub(ch)


@settings(max_examples=examples(12), deadline=None)
@given(
    k=st.integers(1, 64),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    bits=st.integers(MIN_LOGPROB_BITS, MAX_LOGPROB_BITS),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    seed=st.integers(0, 2**16),
)
def test_live_packed_payload_is_within_the_bound_of_float32(
    client: TeacherClient, k: int, lengths: list[int], bits: int, dtype: str, seed: int
) -> None:
    seqs = _sequences(seed, lengths)
    exact = client.score(seqs, k, dtype="float32")
    packed = client.score(seqs, k, dtype=dtype, encoding="packed", logprob_bits=bits)
    mask = exact.mask.numpy()
    assert np.array_equal(packed.mask.numpy(), mask)
    assert np.array_equal(packed.ids.numpy()[mask], exact.ids.numpy()[mask])
    x = exact.logprobs.numpy()[mask]
    error = np.abs(packed.logprobs.numpy()[mask] - x)
    assert (error <= error_bound(x, bits, dtype)[:, None]).all()
    plain = client.score(seqs, k, dtype=dtype)  # the sampled log-probs: as unpacked
    assert packed.sampled_logprobs is not None and plain.sampled_logprobs is not None
    assert np.array_equal(
        packed.sampled_logprobs.numpy()[mask], plain.sampled_logprobs.numpy()[mask], equal_nan=True
    )


def test_teacher_announces_the_packed_encoding(client: TeacherClient) -> None:
    assert client.info().supported_encodings == ("default", "packed")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprob_bits", 17, r"logprob_bits: 17 is outside \[1, 16\]"),
        ("logprob_bits", 0, r"logprob_bits: 0 is outside \[1, 16\]"),
        ("encoding", 9, "encoding: unknown payload encoding 9"),
    ],
)
def test_bad_packed_requests_are_refused_and_the_server_keeps_serving(
    stub: pb_grpc.TeacherStub, field: str, value: int, message: str
) -> None:
    req = build_request([[1, 2, 3, 4]], 4, encoding="packed")
    setattr(req, field, value)
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details())
    ok = stub.Score(build_request([[1, 2, 3, 4]], 4, encoding="packed"), timeout=60)
    assert ok.sequences[0].encoding == pb.PAYLOAD_ENCODING_PACKED and ok.sequences[0].packed_ids


@pytest.fixture(scope="module")
def packed_recording(
    vllm_teacher: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[np.ndarray]]:
    out = tmp_path_factory.mktemp("packed") / "recording"
    seqs = _sequences(7, [5, 33, 17, 60, 2, 24])
    with TeacherClient(vllm_teacher.target, record_to=out) as c:
        c.score(seqs[:3], 64, encoding="packed")
        for _ in c.stream([seqs[3:5], seqs[5:]], 64, encoding="packed", depth=2):
            pass
    return out, seqs


@pytest.fixture(scope="module")
def replay_server(
    packed_recording: tuple[Path, list[np.ndarray]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("packed-replay") / "server.log"
    server = start_server(["--backend", "replay", "--recording", str(packed_recording[0])], log)
    yield server
    server.stop()


def test_packed_recording_replays_byte_identically(
    vllm_teacher: ServerProcess,
    packed_recording: tuple[Path, list[np.ndarray]],
    replay_server: ServerProcess,
) -> None:
    path, seqs = packed_recording
    batch = [seqs[3], seqs[0], seqs[5]]
    spans = [(2, 40), (0, 5), (3, 24)]
    with (
        TeacherClient(vllm_teacher.target) as live,
        TeacherClient(replay_server.target) as served,
        ReplayClient(path) as replay,
    ):
        assert served.info().supported_encodings == ("packed",)
        for kwargs in ({}, {"positions": spans}, {"include_sampled": False}):
            want = live.score(batch, 64, encoding="packed", **kwargs)
            assert_bit_equal(want, replay.score(batch, 64, encoding="packed", **kwargs))
            assert_bit_equal(want, served.score(batch, 64, encoding="packed", **kwargs))
        with pytest.raises(NotRecordedError, match="encoding: the recording holds packed"):
            served.score(batch, 64)
        with pytest.raises(NotRecordedError, match="top_k: the packed recording holds 64"):
            replay.score(batch, 16, encoding="packed")
    # the raw messages: the replay server's answer is the live teacher's, byte for byte
    req = build_request(batch, 64, encoding="packed", request_id="raw")
    with (
        grpc.insecure_channel(vllm_teacher.target) as a,
        grpc.insecure_channel(replay_server.target) as b,
    ):
        one = pb_grpc.TeacherStub(a).Score(req, timeout=60)
        two = pb_grpc.TeacherStub(b).Score(req, timeout=60)
    assert [s.SerializeToString() for s in one.sequences] == [
        s.SerializeToString() for s in two.sequences
    ]
    # the dataset's items: what the live packed answers decode to
    ds = PayloadDataset(path, include_sampled=True)
    index = {ds[i].token_ids.numpy().astype(np.int32).tobytes(): i for i in range(len(ds))}
    items = [ds[index[s.tobytes()]] for s in batch]
    with TeacherClient(vllm_teacher.target) as live:
        assert_bit_equal(live.score(batch, 64, encoding="packed"), collate_payloads(items).payload)


def test_teacher_record_packed_builds_a_dataset_of_the_live_answers(
    vllm_teacher: ServerProcess, tmp_path: Path
) -> None:
    from student_client.offline.record_cli import main

    seqs = _sequences(11, [9, 30, 4])
    (tmp_path / "t.jsonl").write_text("".join(f"{s.tolist()}\n" for s in seqs))
    out = tmp_path / "rec"
    args = ["--teacher", vllm_teacher.target, "--input", str(tmp_path / "t.jsonl")]
    args += ["--output", str(out), "--top-k", "32", "--encoding", "packed"]
    assert main([*args, "--logprob-bits", "5"]) == 0
    ds = PayloadDataset(out, include_sampled=True)
    assert ds.reader.packing is not None and ds.reader.packing.logprob_bits == 5
    with TeacherClient(vllm_teacher.target) as live:
        want = live.score(seqs, 32, encoding="packed", logprob_bits=5)
    assert_bit_equal(want, collate_payloads([ds[i] for i in range(len(ds))]).payload)
    with pytest.raises(
        SystemExit, match="holds K 32 float16 packed at 5 bits; asked K 32 float16 packed at 8 bits"
    ):
        main(args)  # resuming at other bits is refused
