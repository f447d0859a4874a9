"""Candidate ids through real gRPC servers on loopback: the transformers teacher answers
them exactly, every bad input gets its named error and the server answers the next
request (``Score`` and inside a ``ScoreStream``), and a replay teacher serves recorded
candidates byte-identically and refuses the rest with NOT_FOUND naming the positions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from student_client import (
    AsyncTeacherClient,
    MultiTeacherClient,
    PayloadDataset,
    ReplayClient,
    TeacherClient,
)
from student_client.data.assembler import ResponseAssembler
from student_client.offline.dataset import collate_payloads
from student_client.offline.record_cli import main as record_main
from teacher_server.backends.replay_backend import ReplayBackend
from teacher_server.backends.transformers_backend import TransformersBackend
from teacher_server.config import ServerConfig
from teacher_server.grpc_api.answers import encode_response, iter_stream_responses
from teacher_server.validation import Limits, parse_request
from tests.teacher_server.loopback import LoopbackTeacher
from topk_protocol import RequestOptions, SequenceArrays, build_request, decode_sequence, pb
from topk_protocol.errors import ResourceExhaustedError
from topk_protocol.status import REASON_KEY

VOCAB = 512
MAX_C = ServerConfig.max_candidates


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[LoopbackTeacher]:
    backend = TransformersBackend(tiny_model_dir, max_top_k=64, dtype="float32")
    teacher = LoopbackTeacher(backend)
    yield teacher
    teacher.stop()


def _seqs(seed: int, lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


def _cands(seed: int, rows: int, c: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(rows, c)).astype(np.int32)
    ids[rng.random((rows, c)) < 0.2] = -1
    return ids


def _dense(backend: TransformersBackend, seq: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        logits = backend._model(input_ids=torch.as_tensor(seq.astype(np.int64))[None]).logits[0]
        return torch.log_softmax(logits.float(), dim=-1).numpy()


def test_transformers_teacher_scores_candidates(live: LoopbackTeacher) -> None:
    info = live.stub.GetInfo(pb.GetInfoRequest())
    assert info.max_candidates == MAX_C
    seqs = _seqs(0, [13, 7])
    cands = [_cands(1, 9, 5), None]
    req = build_request(seqs, 8, positions=[(2, 11), (0, 7)], dtype="float32", candidate_ids=cands)
    got = live.stub.Score(req, timeout=60)
    a = decode_sequence(got.sequences[0], cands[0])
    want = np.take_along_axis(
        _dense(live.server._backend, seqs[0])[2:11], np.maximum(cands[0], 0), axis=1
    )
    pad = cands[0] == -1
    assert a.candidate_logprobs is not None
    assert np.isnan(a.candidate_logprobs[pad]).all()
    np.testing.assert_allclose(a.candidate_logprobs[~pad], want[~pad], atol=1e-5)
    assert got.sequences[1].num_candidates == 0 and not got.sequences[1].candidate_logprobs
    plain = live.stub.Score(build_request(seqs, 8, positions=[(2, 11), (0, 7)], dtype="float32"))
    assert plain.sequences[0].logprobs == got.sequences[0].logprobs


def _bad(seed: int) -> list[tuple[str, Any, str]]:
    """(what, a mutation of a one-sequence request with S = 6 rows, C = 4, the error's
    expected words)."""

    def set_ids(ids: np.ndarray, c: int) -> Any:
        def mutate(seq: pb.SequenceRequest) -> None:
            seq.candidate_ids = np.asarray(ids, "<i4").tobytes()
            seq.num_candidates = c

        return mutate

    def raw(data: bytes, c: int) -> Any:
        def mutate(seq: pb.SequenceRequest) -> None:
            seq.candidate_ids, seq.num_candidates = data, c

        return mutate

    good = _cands(seed, 6, 4)
    out_of_vocab, below = good.copy(), good.copy()
    out_of_vocab[2, 3] = VOCAB
    below[4, 0] = -2
    over = np.zeros((6, MAX_C + 1))
    return [
        ("id out of vocabulary", set_ids(out_of_vocab, 4), "[2, 3]: 512 is outside [-1, 512)"),
        ("id below -1", set_ids(below, 4), "[4, 0]: -2 is outside [-1, 512)"),
        ("rows of another range", set_ids(good[:5], 4), "expected [S, C] = [6, 4] = 24"),
        ("C over the limit", set_ids(over, MAX_C + 1), f"exceeds max_candidates {MAX_C}"),
        ("bytes not int32", raw(b"\x00" * 7, 4), "not a multiple of 4"),
        ("ids without C", raw(b"\x00" * 96, 0), "num_candidates 0"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_candidates_are_refused_by_name_and_the_server_goes_on(
    live: LoopbackTeacher, case: int
) -> None:
    what, mutate, words = _bad(case)[case]
    seq = _seqs(case, [10])[0]
    req = build_request([seq], 4, positions=[(3, 9)], request_id="bad")
    mutate(req.sequences[0])
    with pytest.raises(grpc.RpcError) as err:
        live.stub.Score(req, timeout=30)
    e: Any = err.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    assert "sequences[0].candidate_ids" in e.details() and words in e.details(), e.details()
    good = build_request(
        [seq], 4, positions=[(3, 9)], request_id="good", candidate_ids=[_cands(0, 6, 4)]
    )
    # Inside a stream: the bad request gets an error message, the others their answers.
    answers = list(live.stub.ScoreStream(iter([good, req, good]), timeout=30))
    errors = [a.error for a in answers if a.HasField("error")]
    assert len(errors) == 1 and words in errors[0].message
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    ok = [a for a in answers if a.final and not a.HasField("error")]
    assert len(ok) == 2 and all(a.sequences[0].num_candidates == 4 for a in ok)
    assert live.stub.Score(good, timeout=30).sequences[0].num_candidates == 4


def _bits(t: torch.Tensor | None) -> bytes:
    assert t is not None
    return t.numpy().tobytes()  # NaN == NaN, bit for bit


def test_recording_with_candidates_replays_byte_identically(
    live: LoopbackTeacher, tmp_path: Path
) -> None:
    seqs = _seqs(3, [11, 6, 9])
    positions = [(4, 11), (0, 6), (2, 9)]
    cands = [_cands(4, 7, 6), None, _cands(5, 7, 3)]
    record = tmp_path / "rec"
    kwargs: dict[str, Any] = {"positions": positions, "candidate_ids": cands, "dtype": "float32"}
    with TeacherClient(f"127.0.0.1:{live.server.port}", record_to=record) as client:
        payload = client.score(seqs, 8, **kwargs)
        plain = client.score(seqs, 8, positions=positions, dtype="float32")
    assert payload.candidate_ids is not None and payload.candidate_ids.shape == (3, 7, 6)
    assert (payload.candidate_ids[1] == -1).all() and payload.candidate_logprobs[1].isnan().all()

    # ReplayClient: the same call, the same bytes; a subset of the recorded ids too.
    with ReplayClient(record) as replay:
        again = replay.score(seqs, 8, **kwargs)
        for name in ("ids", "logprobs", "sampled_logprobs", "candidate_ids", "candidate_logprobs"):
            assert _bits(getattr(again, name)) == _bits(getattr(payload, name)), name
        assert _bits(replay.score(seqs, 8, positions=positions, dtype="float32").logprobs) == (
            _bits(plain.logprobs)
        )
        subset = [c[1:5, ::-1].copy() for c in (cands[0],)]
        part = replay.score([seqs[0]], 8, positions=[(5, 9)], dtype="float16", candidate_ids=subset)
        want = payload.candidate_logprobs[0, 1:5].flip(1).half().float()
        assert _bits(part.candidate_logprobs[0]) == _bits(want)
        missing = cands[0].copy()
        missing[3, 0] = (int(missing[3].max()) + 1) % VOCAB  # an id not recorded there
        with pytest.raises(Exception, match=r"candidate_ids at positions \[7\] are not recorded"):
            replay.score(
                [seqs[0]], 8, positions=[(4, 11)], candidate_ids=[missing], dtype="float32"
            )

    # PayloadDataset: each row's recorded candidates; collated like the live payload.
    ds = PayloadDataset(record)
    by_len = {len(item.token_ids): item for item in ds}
    batch = collate_payloads([by_len[11], by_len[6], by_len[9]])
    got = batch.payload
    assert got.candidate_ids is not None and got.candidate_logprobs is not None
    for b, (lo, hi) in enumerate(positions):
        n = hi - lo
        assert _bits(got.candidate_ids[b, :n]) == _bits(payload.candidate_ids[b, :n])
        assert _bits(got.candidate_logprobs[b, :n]) == _bits(payload.candidate_logprobs[b, :n])

    # The replay server: the live teacher's answer bytes; NOT_FOUND naming the positions.
    replay_server = LoopbackTeacher(ReplayBackend(record))
    try:
        req = build_request(seqs, 8, request_id="x", **kwargs)
        assert _sequences(replay_server.stub.Score(req)) == _sequences(live.stub.Score(req))
        bad = build_request(
            [seqs[0]], 8, positions=[(4, 11)], candidate_ids=[missing], dtype="float32"
        )
        with pytest.raises(grpc.RpcError) as err:
            replay_server.stub.Score(bad)
        e: Any = err.value
        assert e.code() == grpc.StatusCode.NOT_FOUND
        assert dict(e.trailing_metadata())[REASON_KEY] == "not_recorded"
        assert "candidate_ids at positions [7] are not recorded" in e.details()
        # A recorded sequence without recorded candidates at those positions.
        unrec = build_request([seqs[1]], 8, candidate_ids=[_cands(9, 6, 2)], dtype="float32")
        with pytest.raises(grpc.RpcError, match="recorded without candidate ids"):
            replay_server.stub.Score(unrec)
        assert replay_server.stub.Score(req).sequences[0].num_candidates == 6  # still serving
    finally:
        replay_server.stop()


def _sequences(msg: pb.ScoreResponse) -> list[bytes]:
    """The payload messages' bytes (``teacher_seconds`` is each server's own timing)."""
    return [s.SerializeToString() for s in msg.sequences]


def test_async_and_multi_teacher_clients_route_candidates(
    live: LoopbackTeacher, tiny_model_dir: Path
) -> None:
    """``AsyncTeacherClient.score`` and ``MultiTeacherClient.score`` with
    ``candidate_ids``: each row's candidates go with it to its teacher, and come back in
    input order, equal to asking one teacher directly."""
    other = LoopbackTeacher(TransformersBackend(tiny_model_dir, max_top_k=64, dtype="float32"))
    seqs = _seqs(11, [8, 5, 7])
    cands = [_cands(12, 8, 4), _cands(13, 5, 2), None]
    target = f"127.0.0.1:{live.server.port}"
    try:
        with TeacherClient(target) as one:
            direct = one.score(seqs, 8, candidate_ids=cands, dtype="float32")

        async def via_async() -> Any:
            async with AsyncTeacherClient(target) as client:
                return await client.score(seqs, 8, candidate_ids=cands, dtype="float32")

        teachers = {"a": target, "b": f"127.0.0.1:{other.server.port}"}
        with MultiTeacherClient(teachers) as multi:
            routed = multi.score(
                seqs, 8, teacher=["b", "a", "b"], candidate_ids=cands, dtype="float32"
            )
        for got in (asyncio.run(via_async()), routed):
            for name in ("ids", "logprobs", "candidate_ids", "candidate_logprobs"):
                assert _bits(getattr(got, name)) == _bits(getattr(direct, name)), name
        assert direct.candidate_ids is not None and direct.candidate_ids.shape == (3, 8, 4)
        assert (direct.candidate_ids[1, :, 2:] == -1).all()  # C 2 padded to the batch's 4
        assert (direct.candidate_ids[2] == -1).all()
    finally:
        other.stop()


def _check_replay(live: LoopbackTeacher, out: Path, seqs: list[np.ndarray], cands: Any) -> None:
    """The recording at ``out`` answers ``seqs`` with ``cands`` as the teacher does."""
    with TeacherClient(f"127.0.0.1:{live.server.port}") as client:
        want = client.score(seqs, 8, candidate_ids=cands, dtype="float32")
    with ReplayClient(out) as replay:
        got = replay.score(seqs, 8, candidate_ids=cands, dtype="float32")
    assert _bits(got.candidate_logprobs) == _bits(want.candidate_logprobs)


def test_teacher_record_cli_records_candidates(live: LoopbackTeacher, tmp_path: Path) -> None:
    seqs = _seqs(21, [6, 9])
    cands = [_cands(22, 6, 3), _cands(23, 9, 3)]
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"input_ids": s.tolist(), "student_top": c.tolist()}) + "\n"
            for s, c in zip(seqs, cands, strict=True)
        )
    )
    out = tmp_path / "rec"
    args = [
        "--teacher", f"127.0.0.1:{live.server.port}", "--input", str(src), "--output", str(out),
        "--top-k", "8", "--dtype", "float32", "--candidate-column", "student_top",
    ]  # fmt: skip
    assert record_main(args) == 0
    _check_replay(live, out, seqs, cands)
    assert record_main(args) == 0  # a re-run: everything recorded with these candidates
    with ReplayClient(out) as replay:
        assert len(replay) == 2
    # other candidates for the same tokens (a Parquet input, read a row group at a time)
    # are not recorded yet: both rows are scored again, then a re-run scores none
    other = [_cands(24, 6, 2), _cands(25, 9, 4)]
    pq.write_table(
        pa.table({"input_ids": [s.tolist() for s in seqs], "top": [c.tolist() for c in other]}),
        tmp_path / "in.parquet",
        row_group_size=1,
    )
    args[3], args[-1] = str(tmp_path / "in.parquet"), "top"
    for _ in range(2):
        assert record_main(args) == 0
        with ReplayClient(out) as replay:
            assert len(replay) == 4
    _check_replay(live, out, seqs, other)


def test_stream_chunks_count_candidate_bytes_and_reassemble() -> None:
    """Row chunks of a ScoreStream answer stay under the byte budget with the candidate
    log-probs counted, and the client's assembler joins them into the unary answer."""
    rng = np.random.default_rng(5)
    seqs = _seqs(31, [23, 4, 17])
    cands = [_cands(32, 23, 9), None, _cands(33, 17, 2)]
    req = build_request(seqs, 4, candidate_ids=cands, dtype="bfloat16", request_id="s")
    options = RequestOptions.from_proto(req)
    scored = []
    for s, c in zip(seqs, cands, strict=True):
        n = len(s)
        lps = -np.sort(rng.exponential(2.0, (n, 4)), axis=1).astype(np.float32)
        clp = None if c is None else np.where(c == -1, np.nan, -rng.random(c.shape)).astype("f4")
        ids = rng.integers(0, VOCAB, (n, 4)).astype(np.int32)
        scored.append(SequenceArrays(ids, lps, -rng.random(n).astype("f4"), 0, c, clp))
    budget = 200
    msgs = list(iter_stream_responses("s", scored, options, chunk_bytes=budget))
    assert len(msgs) > 5
    for m in msgs:
        sizes = [
            int(p.num_positions) * options.bytes_per_row(num_candidates=int(p.num_candidates))
            for p in m.sequences
        ]
        assert sum(sizes) <= budget or (len(sizes) == 1 and int(m.sequences[0].num_positions) == 1)
    streamed = ResponseAssembler(req)
    for m in msgs:
        streamed.add(m)
    unary = ResponseAssembler(req)
    unary.add(pb.ScoreResponse.FromString(encode_response(_parsed(req), scored, 0.0)))
    a, b = streamed.payload(), unary.payload()
    for name in ("ids", "logprobs", "sampled_logprobs", "candidate_ids", "candidate_logprobs"):
        assert _bits(getattr(a, name)) == _bits(getattr(b, name)), name
    assert streamed.merged_response().sequences[0].SerializeToString() == (
        unary.merged_response().sequences[0].SerializeToString()
    )


def _parsed(req: pb.ScoreRequest) -> Any:
    return parse_request(req, Limits(vocab_size=VOCAB))


def test_client_refuses_a_request_over_its_message_limit_by_name(live: LoopbackTeacher) -> None:
    seq = _seqs(41, [4096])[0]
    cands = np.zeros((4096, 300), np.int32)  # 4.7 MiB of ids
    with TeacherClient(f"127.0.0.1:{live.server.port}", max_message_mb=4) as client:
        with pytest.raises(ResourceExhaustedError, match=r"request: \d+ bytes .* max_message_mb 4"):
            client.score([seq], 4, candidate_ids=[cands])
        assert client.score([seq[:8]], 4).ids.shape == (1, 8, 4)
