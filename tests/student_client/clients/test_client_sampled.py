"""Sampled payloads end to end on a real transformers-backed teacher (tiny model): the
draws fit the dense teacher distribution, the same seed gives the same answer (another
batch, another position range, streamed, recorded and replayed, from the dataset), bad
input is refused naming field and limit while the server keeps serving, and a recording
answers only the sampled requests it was made at."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server
from sampling_checks import chi_square_p_value, equal_mass_chi_square

from student_client.clients.blocking import TeacherClient
from student_client.losses import TeacherTargets
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay_client import ReplayClient
from teacher_server.backends.replay_backend import ReplayBackend
from teacher_server.backends.transformers_backend import TransformersBackend
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, build_request, pb
from topk_protocol._generated import teacher_pb2_grpc as pb_grpc
from topk_protocol.checks import MAX_SAMPLES
from topk_protocol.errors import InvalidRequestError, NotRecordedError, RecordingError

N, SEED, VOCAB = 64, 1234, 512
ALPHA = 1e-3


@pytest.fixture(scope="module")
def teacher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("teacher") / "server.log"
    server = start_server(
        ["--backend", "transformers", "--model", str(tiny_model_dir), "--chunk-kb", "1"], log
    )
    yield server
    server.stop()


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n) for n in (40, 9, 25)]


def test_draws_fit_the_dense_teacher_distribution(reference_backend: TransformersBackend) -> None:
    # The transformers backend's draws against its own full distribution (K = V, float32):
    # the chi-square of the equal-mass bins (tests/sampling_checks.py) over 3 x 40 rows.
    stats, dofs, wrong = 0.0, 0, 0.0
    for i, x in enumerate(_sequences() * 2):
        seq = ParsedSequence(x.astype(np.int32), 0, len(x))
        opts = RequestOptions(MAX_SAMPLES, "float32", samples=MAX_SAMPLES, seed=SEED + i)
        got = reference_backend.score_sync(seq, opts)
        dense = reference_backend.score_sync(seq, RequestOptions(VOCAB, "float32"))
        full = torch.full((len(x), VOCAB), -torch.inf).scatter_(
            1, torch.from_numpy(dense.ids).long(), torch.from_numpy(dense.logprobs)
        )
        assert got.sample_counts is not None
        ids, counts = torch.from_numpy(got.ids).long(), torch.from_numpy(got.sample_counts).long()
        drawn = counts > 0
        np.testing.assert_array_equal(
            got.logprobs[drawn.numpy()], torch.gather(full, 1, ids)[drawn].numpy()
        )
        statistic, dof = equal_mass_chi_square(ids, counts, full)
        stats, dofs = stats + statistic, dofs + dof
        # power: the same draws against the next position's distribution do not fit
        wrong += equal_mass_chi_square(ids[:-1], counts[:-1], full[1:])[0]
    p_value = chi_square_p_value(stats, dofs)
    assert p_value > ALPHA, f"chi-square {stats:.1f} on {dofs} dof: p = {p_value:.3g}"
    assert chi_square_p_value(wrong, dofs) < ALPHA


def test_same_seed_same_answer_live_recorded_and_replayed(
    teacher: ServerProcess, reference_backend: TransformersBackend, tmp_path: Path
) -> None:
    seqs = _sequences()
    sampling = {"samples": N, "seed": SEED}
    with TeacherClient(teacher.target, record_to=tmp_path / "rec") as client:
        assert client.info().max_samples == MAX_SAMPLES
        first = client.score(seqs, N, dtype="float32", **sampling)
    with TeacherClient(teacher.target) as client:
        again = client.score(seqs, N, dtype="float32", **sampling)
        alone = client.score([seqs[2][:]], N, dtype="float32", positions=[(5, 20)], **sampling)
        streamed = next(iter(client.stream([seqs], N, dtype="float32", **sampling)))
        other = client.score(seqs, N, dtype="float32", samples=N, seed=SEED + 1)
    assert first.sample_counts is not None and alone.sample_counts is not None
    assert bool((first.sample_counts.sum(-1)[first.mask] == N).all())
    for p in (again, streamed):
        assert torch.equal(p.ids, first.ids) and torch.equal(p.sample_counts, first.sample_counts)
        assert torch.equal(p.logprobs, first.logprobs)
    assert torch.equal(alone.ids[0, :15], first.ids[2, 5:20])  # batch- and range-invariant
    assert torch.equal(alone.sample_counts[0, :15], first.sample_counts[2, 5:20])
    assert not torch.equal(other.ids, first.ids)
    direct = reference_backend.score_sync(
        ParsedSequence(seqs[0].astype(np.int32), 0, 40), RequestOptions(N, "float32", **sampling)
    )
    np.testing.assert_array_equal(direct.ids, first.ids[0].numpy())
    np.testing.assert_array_equal(direct.sample_counts, first.sample_counts[0].numpy())

    with ReplayClient(tmp_path / "rec") as replay:
        replayed = replay.score(seqs, N, dtype="float32", **sampling)
        assert torch.equal(replayed.ids, first.ids)
        assert torch.equal(replayed.sample_counts, first.sample_counts)
        assert torch.equal(replayed.logprobs, first.logprobs)
        with pytest.raises(
            NotRecordedError, match=r"samples: the recording was made at 64, the request asks for 0"
        ):
            replay.score(seqs, 8, dtype="float32")
        with pytest.raises(
            NotRecordedError,
            match=r"seed: the recording was made at 1234, the request asks for 1235",
        ):
            replay.score(seqs, N, dtype="float32", samples=N, seed=SEED + 1)
        with pytest.raises(
            NotRecordedError,
            match=r"samples: the recording was made at 64, the request asks for 32",
        ):
            replay.score(seqs, 32, dtype="float32", samples=32, seed=SEED)
    backend = ReplayBackend(tmp_path / "rec")  # the server's replay backend: the same rules
    asyncio.run(backend.start())
    try:
        assert backend.info.max_samples == N
        seq = ParsedSequence(seqs[0].astype(np.int32), 0, 40)
        served = asyncio.run(backend.score(seq, RequestOptions(N, "float32", **sampling)))
        assert served.sample_counts is not None
        np.testing.assert_array_equal(served.sample_counts, first.sample_counts[0].numpy())
        with pytest.raises(NotRecordedError, match=r"samples: the recording was made at 64"):
            asyncio.run(backend.score(seq, RequestOptions(8, "float32")))
    finally:
        asyncio.run(backend.close())
    dataset = PayloadDataset(tmp_path / "rec")
    batch = collate_payloads([dataset[i] for i in range(len(dataset))])
    assert batch.payload.sample_counts is not None
    assert int(batch.payload.sample_counts.sum()) == N * sum(len(s) for s in seqs)


def test_bad_sampled_requests_are_refused_and_the_server_keeps_serving(
    teacher: ServerProcess,
) -> None:
    seqs = _sequences()
    with TeacherClient(teacher.target) as client:
        with pytest.raises(
            InvalidRequestError, match=rf"samples: 300 is outside \[0, {MAX_SAMPLES}\]"
        ):
            client.score(seqs, 300, samples=300, seed=1)
        with pytest.raises(InvalidRequestError, match=r"seed: required with samples 16"):
            client.score(seqs, 16, samples=16)
    # the same refusals from the server itself (a raw request the client would not build)
    channel = grpc.insecure_channel(teacher.target)
    stub = pb_grpc.TeacherStub(channel)
    good = build_request(seqs, 16, samples=16, seed=1)
    for change, message in (
        (
            {"samples": 300, "top_k": 300},
            rf"samples: 300 is outside \[1, {MAX_SAMPLES}\] \(max_samples\)",
        ),
        ({"samples": 16, "top_k": 8}, r"top_k: 8, .* top_k must equal samples \(16\)"),
    ):
        bad = pb.ScoreRequest()
        bad.CopyFrom(good)
        for name, value in change.items():
            setattr(bad, name, value)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() is not None
        assert re.search(message, e.value.details()), e.value.details()
    no_seed = pb.ScoreRequest()
    no_seed.CopyFrom(good)
    no_seed.ClearField("seed")
    with pytest.raises(grpc.RpcError, match="seed: required with samples 16"):
        stub.Score(no_seed, timeout=30)
    answer = stub.Score(good, timeout=30)  # still serving
    assert len(answer.sequences) == 3 and answer.sequences[0].sample_counts
    channel.close()


def test_a_sampled_request_needs_no_top_k(teacher: ServerProcess) -> None:
    """``score(seqs, samples=N, seed=S)``: K is N, not repeated."""
    seqs = _sequences()
    with TeacherClient(teacher.target) as client:
        short = client.score(seqs, samples=N, seed=SEED, dtype="float32")
        long = client.score(seqs, N, samples=N, seed=SEED, dtype="float32")
        tempered = client.score(seqs, samples=N, seed=SEED, proposal_temperature=1.5)
        with pytest.raises(InvalidRequestError, match=r"^top_k: required \(or samples=N"):
            client.score(seqs)
    # the proposal temperature travels with the payload into the loss's teacher value
    assert (short.proposal_temperature, tempered.proposal_temperature) == (1.0, 1.5)
    assert TeacherTargets.from_payload(tempered).proposal_temperature == 1.5
    assert short.top_k == N and torch.equal(short.ids, long.ids)
    assert short.sample_counts is not None and long.sample_counts is not None
    assert torch.equal(short.sample_counts, long.sample_counts)


def test_a_recording_client_refuses_what_it_cannot_record_before_sending(
    teacher: ServerProcess, tmp_path: Path
) -> None:
    """A ``record_to=`` client holds the options of its first request: a sampled or a
    packed request after a default one is refused by name before it is sent (no answer is
    lost), the client keeps serving, and the recording replays byte-identically."""
    seqs = _sequences()
    rec = tmp_path / "rec"
    with TeacherClient(teacher.target, record_to=rec) as client:
        first = client.score(seqs, N, dtype="float32")
        with pytest.raises(RecordingError, match=r"options: recorded .*'samples': 0"):
            client.score(seqs, samples=N, seed=SEED, dtype="float32")
        with pytest.raises(RecordingError, match=r"encoding: a packed answer"):
            client.score(seqs, N, dtype="float32", encoding="packed")
        with pytest.raises(RecordingError, match=r"top_k: 2 is less than the recorded"):
            next(iter(client.stream([seqs], 2, dtype="float32")))
        again = client.score(seqs, N, dtype="float32")
    assert torch.equal(again.logprobs, first.logprobs)
    with ReplayClient(rec) as replay:
        replayed = replay.score(seqs, N, dtype="float32")
    assert replayed.logprobs.numpy().tobytes() == first.logprobs.numpy().tobytes()
    assert torch.equal(replayed.ids, first.ids)
